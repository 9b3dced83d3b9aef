"""env.tools in a real job: the units MCP server's tools (listed when the job starts) and the
sandboxed python tool reach every episode's prompt and answer its calls; a server that cannot be
listed fails the job's start in one line; the gateway refuses an MCP URL the env.url rule refuses."""


import pytest

from envs.units.server import app as units_app
from opentinker.agent import ChatFormat, EpisodeLimits, run_episodes
from opentinker.backend import SamplingParams
from opentinker.core.env_hosts import EnvHosts
from opentinker.core.spec import SpecError
from opentinker.tools.job_tools import JobTools
from tests.conftest import tiny_spec
from tests.served import ServedApp
from tests.test_tool_calls import ScriptedEngine, _call


@pytest.fixture(scope="module")
def units():
    served = ServedApp(lambda: units_app().http_app(path="/mcp"))
    yield f"{served.url}/mcp"
    served.stop()


def _sources(*entries):
    return tiny_spec("/tmp", env={"game": "envs.units:UnitsGame", "tools": list(entries)}).env.tools


def test_a_jobs_mcp_tools_answer_its_episodes(units, tiny):
    _, tok = tiny
    tools = JobTools(_sources({"mcp": units, "timeout_s": 10}), EnvHosts.parse("127.0.0.0/8"))
    try:
        assert [t.name for t in tools.tools] == ["convert", "list_units"]
        from envs.units import UnitsGame

        engine = ScriptedEngine(tok, [_call("convert", value=3, from_unit="wumps", to_unit="zorbs"), "Answer: 36"])
        (traj,) = run_episodes(engine, ChatFormat(tok), [UnitsGame()], [{"question": "How many zorbs are 3 wumps?", "answer": 36}],
                               SamplingParams(max_new_tokens=64), EpisodeLimits(max_turns=3, max_total_tokens=2048, tools=tools.tools))
        assert traj.reward == 1.0 and traj.messages[-2] == {"role": "tool", "content": "36", "name": "convert", "tool_call_id": "call_0"}
        assert '"name": "convert"' in tok.decode(engine.prompts[0])
    finally:
        tools.close()


def test_an_mcp_server_that_cannot_be_listed_fails_the_start_in_one_line():
    with pytest.raises(RuntimeError, match=r"^env.tools.mcp: http://127.0.0.1:9/mcp: no MCP server's tools listed") as info:
        JobTools(_sources({"mcp": "http://127.0.0.1:9/mcp", "timeout_s": 2}), EnvHosts.parse("127.0.0.0/8"))
    assert "\n" not in str(info.value)
    with pytest.raises(ValueError, match="169.254.169.254"):
        JobTools(_sources({"mcp": "http://169.254.169.254/mcp"}), EnvHosts.parse("127.0.0.0/8"))


@pytest.mark.usefixtures("bubblewrap")
def test_the_python_tool_from_the_spec_runs_in_the_sandbox(tiny):
    tools = JobTools(_sources({"python": {"wall_s": 3, "memory_mb": 128}}), EnvHosts.parse("127.0.0.0/8"))
    (python,) = tools.tools
    assert python.run({"code": "import os; print(os.getuid(), 6 * 7)"}) == "65534 42"
    assert "timed out" in python.run({"code": "while True: pass"}).lower()


def test_a_short_rl_job_with_an_mcp_tool(units, tmp_path, monkeypatch):
    """A real job: its sampler lists the tools at its start, its episodes call them, metrics count them."""
    from opentinker.rl import RLJob

    monkeypatch.setenv("OPENTINKER_ENV_URL_ALLOW", "127.0.0.0/8")
    spec = tiny_spec(tmp_path, env={"game": "envs.units:UnitsGame", "tools": [{"mcp": units, "timeout_s": 10}], "config": {"val_size": 8}},
                     rollout={"max_new_tokens": 8, "max_turns": 2, "max_total_tokens": 1024}, optimization={"steps": 1},
                     checkpoint={"every": 0})
    job = RLJob(spec, job_id="job-tools")
    try:
        assert [t.name for t in job.sampler.tools.tools] == ["convert", "list_units"]
        m = job.run().history[-1]
    finally:
        job.close()
    assert m["rollout/failed_episodes"] == 0 and m["rollout/reward_mean"] >= 0  # the tiny model rarely calls: no count asserted


def test_the_gateway_refuses_an_mcp_url_the_env_rule_refuses():
    from opentinker.control.gateway.confine import confine_env
    from opentinker.core.settings import Settings

    settings = Settings()
    for url in ("http://169.254.169.254/mcp", f"http://127.0.0.1:{settings.gateway_port}/mcp", "http://10.0.0.1/mcp"):
        with pytest.raises(SpecError):
            confine_env(settings, "alice", {"game": "envs.units:UnitsGame", "tools": [{"mcp": url}]})


def test_the_example_specs_of_agents_with_tools_load():
    from opentinker.core.spec import load_spec

    code = load_spec("examples/code_interpreter_grpo.yaml")
    assert code.env.game == "envs.code_interpreter:CodeInterpreterMathGame" and code.optimization.steps == 40
    units = load_spec("examples/mcp_units_grpo.yaml")
    assert units.env.tools[0].mcp == "http://127.0.0.1:8400/mcp"
