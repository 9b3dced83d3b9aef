"""OpenEnv servers train here unmodified: the real openenv-core package, its own app factory, real
servers on 127.0.0.1 started here, episodes played through our adapter and the agent loop (a scripted
policy with the real tokenizer: no language model). A refused action costs its turn; an environment
that raises or hangs costs its episode, counted, and the next episode plays on."""

import asyncio
import base64
import os
import re
import subprocess
import sys
import threading
import time
from typing import Any, Optional

import httpx
import pytest
import typer
import uvicorn

pytest.importorskip("openenv", reason="pip install 'opentinker[openenv]'")

from openenv.core.generic_client import GenericEnvClient  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402
from typer.testing import CliRunner  # noqa: E402

from opentinker.agent import ChatFormat, EpisodeLimits, run_episodes  # noqa: E402
from opentinker.backend import SamplingParams  # noqa: E402
from opentinker.backend.sequences import Completion  # noqa: E402
from opentinker.cli.env import env_app  # noqa: E402
from opentinker.control.gateway.confine import confine_env  # noqa: E402
from opentinker.core.settings import Settings  # noqa: E402
from opentinker.core.spec import SpecError, parse_spec  # noqa: E402
from opentinker.core.tokens import job_token  # noqa: E402
from opentinker.env import environment_from_spec  # noqa: E402
from opentinker.env.openenv_client import ConfinedEnvClient, ConnectionAnswered, OpenEnvGameClass, ClientLoop  # noqa: E402
from opentinker.env.openenv_server import create_openenv_app  # noqa: E402
from opentinker.model.loading import tokenizer_path  # noqa: E402
from opentinker.tracking.metrics import episode_stats  # noqa: E402
from tests import openenv_games  # noqa: E402
from tests.openenv_games import EchoAction, EchoEnv, EchoObservation, GuessEnv, TroubleEnv  # noqa: E402
from tests.served import ServedApp, free_port  # noqa: E402

TOKEN = "openenv-test-token"
JOB_ID = "job-openenv"
LIMITS = EpisodeLimits(max_turns=6, max_total_tokens=2048, step_timeout_s=20)


class Served(ServedApp):
    """OpenEnv's app for one Environment class behind a real uvicorn, in a thread of this process."""

    def __init__(self, env_cls, tokens=(TOKEN,)):
        super().__init__(lambda: create_openenv_app(env_cls, tokens=list(tokens) or None))


@pytest.fixture(scope="module")
def servers():
    openenv_games.RELEASE.clear()
    job = job_token(Settings().stack_secret(), JOB_ID)  # what a job shows (OPENTINKER_SECRET: tests/conftest.py)
    served = {"echo": Served(EchoEnv, tokens=(TOKEN, job)), "guess": Served(GuessEnv), "trouble": Served(TroubleEnv), "open": Served(EchoEnv, tokens=())}
    yield served
    openenv_games.RELEASE.set()  # the hung environment's thread returns, so its server can stop
    for s in served.values():
        s.stop()


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(tokenizer_path())


class ByPrompt:
    """A scripted policy: episode i's replies are `replies[seed][turn]`, found from its prompt's
    'seed N' (the first observation) and the number of turns it has had."""

    policy_version = 0

    def __init__(self, tok, replies):
        self.tok, self.replies = tok, replies

    def generate(self, prompts, params, budgets=None, **_):
        out = []
        for prompt in prompts:
            text = self.tok.decode(prompt)
            found = re.search(r"seed (\d+)", text)
            seed = int(found.group(1)) if found else next(iter(self.replies))
            reply = self.replies[seed][text.count("<|im_start|>assistant") - 1]
            ids = self.tok(reply, add_special_tokens=False)["input_ids"] + [self.tok.eos_token_id]
            out.append(Completion(token_ids=ids, logprobs=[0.0] * len(ids), finish_reason="stop"))
        return out


def _spec(url, **env):
    return parse_spec({"model": {"name": "tiny-random"}, "env": {"url": url, "protocol": "openenv", "timeout_s": 5, "retries": 1,
                                                                  "config": {"val_size": 4}, **env}, "seed": 3})


def _play(tok, game_class, replies):
    """One episode per seed in `replies`, concurrently, through the agent loop."""
    seeds = list(replies)
    games = [game_class() for _ in seeds]
    return run_episodes(ByPrompt(tok, replies), ChatFormat(tok), games, [{"__seed__": s} for s in seeds], SamplingParams(max_new_tokens=32), LIMITS)


def test_openenv_clients_use_our_served_environment(servers):
    """OpenEnv's own client against `create_openenv_app`: the app is OpenEnv's, unchanged."""
    client = GenericEnvClient(base_url=servers["open"].url).sync()
    with client:
        assert client.reset(seed=4).observation == {"echoed_message": "ready (seed 4)"}
        result = client.step({"message": "stop"})
        assert (result.observation, result.reward, result.done) == ({"echoed_message": "stop"}, 1.0, True)
    schema = httpx.get(f"{servers['echo'].url}/schema", headers={"Authorization": f"Bearer {TOKEN}"}).json()
    assert schema["action"]["required"] == ["message"]


def test_a_served_openenv_asks_for_the_token(servers):
    url = servers["echo"].url
    assert httpx.get(f"{url}/health").status_code == 200
    assert httpx.get(f"{url}/schema").status_code == 401
    with pytest.raises(ConnectionError):  # the WebSocket too: its handshake is refused
        GenericEnvClient(base_url=url).sync().connect()
    game = OpenEnvGameClass(url, timeout_s=5, token="wrong")()
    with pytest.raises(RuntimeError, match="HTTP 401"):
        game.reset(__seed__=1)
    with pytest.raises(ConnectionAnswered, match="403"):  # our client, the wrong token: refused, not tried again
        ClientLoop.run(ConfinedEnvClient(url, 5, "wrong").connect(), 10)


def test_a_redirect_is_refused_not_followed(servers):
    """websockets follows redirects to any host; a tenant's server must not send the job elsewhere."""
    target = servers["open"].url.replace("http", "ws") + "/ws"

    async def redirector(scope, receive, send):
        if scope["type"] == "websocket":
            await send({"type": "websocket.http.response.start", "status": 307, "headers": [(b"location", target.encode())]})
            await send({"type": "websocket.http.response.body", "body": b""})

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(redirector, host="127.0.0.1", port=port, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    try:
        with pytest.raises(ConnectionAnswered, match="307"):
            ClientLoop.run(ConfinedEnvClient(f"http://127.0.0.1:{port}", 5, TOKEN).connect(), 10)
    finally:
        server.should_exit = True
        thread.join(10)


def test_a_job_plays_a_text_field_environment_to_the_end(servers, tok):
    """env: {url, protocol: openenv}: the job's token goes along; the text fills the action's one field."""
    env = environment_from_spec(_spec(servers["echo"].url), job_id=JOB_ID)
    assert env.game_class.servers[0].token == job_token(Settings().stack_secret(), JOB_ID)
    task = env.validation_tasks(1)[0]
    game = env.make_game()
    (traj,) = run_episodes(ByPrompt(tok, {task["__seed__"]: ["hello there", "stop"]}), ChatFormat(tok), [game], [task],
                           SamplingParams(max_new_tokens=32), LIMITS)
    assert not traj.failed and traj.stop_reason == "done" and traj.reward == 1.0
    first = next(m["content"] for m in traj.messages if m["role"] == "user")
    assert first == f"ready (seed {task['__seed__']})"  # the observation's one text field
    assert [t.observation for t in traj.turns] == ["hello there", "stop"]
    assert traj.info == {"illegal_moves": 0, "moves": 2}
    assert game.get_system_prompt() == ""  # nothing to explain: the reply is the action


def test_json_actions_are_checked_against_the_schema(servers, tok):
    """GuessEnv's action has an integer field: the text must be JSON valid against /schema; a refused
    action costs its turn (reward 0, the reason shown), the episode goes on, and it is counted."""
    game_class = OpenEnvGameClass(servers["guess"].url, timeout_s=5, token=TOKEN)
    secret = __import__("random").Random(7).randrange(10)
    replies = {7: ["seven", '{"guess": 12}', '{"guess": 3, "extra": 1}', "```json\n{\"guess\": %d}\n```" % ((secret + 1) % 10),
                   '{"guess": %d, "note": "sure"}' % secret]}
    (traj,) = _play(tok, game_class, replies)
    assert not traj.failed and traj.stop_reason == "done" and traj.reward == 1.0
    observations = [t.observation for t in traj.turns]
    assert observations[0].startswith("Your action was refused (the action must be one JSON object")
    assert observations[1].startswith("Your action was refused (guess: 12 is greater than the maximum of 9)")
    assert "Additional properties are not allowed" in observations[2]
    assert observations[3] in ('{"hint": "higher", "tries": 1}', '{"hint": "lower", "tries": 1}')  # JSON: no text field
    assert observations[4] == '{"hint": "right", "tries": 2}'
    assert [t.reward for t in traj.turns] == [0.0, 0.0, 0.0, 0.0, 1.0]
    assert traj.info == {"illegal_moves": 3, "moves": 2}
    assert episode_stats([traj], "rollout")["rollout/illegal_move_rate"] == 0.6
    assert '"guess"' in game_class().get_system_prompt() and "metadata" not in game_class().get_system_prompt()


def test_the_servers_own_validation_refuses_a_turn_too(servers):
    """A `pattern` (not checked here: a hostile regular expression could spin the job's process) is
    checked by the server: it answers VALIDATION_ERROR, the turn is refused, the session plays on."""
    game = OpenEnvGameClass(servers["trouble"].url, timeout_s=5, token=TOKEN)()
    assert game.reset(__seed__=2) == "ready (seed 2)"
    refused = game.step("#hashtag")
    assert refused.reward == 0.0 and not refused.done and "VALIDATION_ERROR" in refused.observation
    assert game.step("").observation.startswith("Your action was refused (message: '' should be non-empty")
    played = game.step("stop")
    assert (played.observation, played.reward, played.done, played.info) == ("stop", 1.0, True, {"illegal_moves": 2, "moves": 1})
    game.close()


def test_a_custom_validators_refusal_ends_the_session_in_openenv(servers):
    """openenv-core 0.3.0 cannot send the errors of a pydantic validator that raises ValueError (the
    exception is in the error's ctx): it ends the session with SESSION_ERROR, so that episode is lost."""
    game = OpenEnvGameClass(servers["trouble"].url, timeout_s=5, token=TOKEN)()
    game.reset(__seed__=2)
    with pytest.raises(RuntimeError, match="SESSION_ERROR"):
        game.step("you rude thing")
    game.close()


def test_raising_and_hanging_environments_cost_one_episode_each(servers, tok):
    game_class = OpenEnvGameClass(servers["trouble"].url, timeout_s=1.5, retries=0, token=TOKEN)
    started = time.monotonic()
    trajs = _play(tok, game_class, {1: ["boom"], 2: ["hang"], 3: ["hello", "stop"]})
    assert time.monotonic() - started < 10
    boom, hang, fine = trajs
    assert boom.failed and "the environment broke" in boom.failure and "EXECUTION_ERROR" in boom.failure
    assert hang.failed and "step" in hang.failure and "no answer" in hang.failure
    assert not fine.failed and fine.reward == 1.0
    stats = episode_stats(trajs, "rollout")
    assert stats["rollout/failed_episodes"] == 2.0 and stats["rollout/reward_mean"] == 1.0
    (after,) = _play(tok, game_class, {4: ["stop"]})  # the job lives on: the next episode plays
    assert not after.failed and after.reward == 1.0


def test_an_unreachable_server_costs_episodes_not_the_job(tok):
    game_class = OpenEnvGameClass(f"http://127.0.0.1:{free_port()}", timeout_s=1, retries=1, token=TOKEN)
    env = environment_from_spec(_spec(f"http://127.0.0.1:{free_port()}"), job_id=JOB_ID)  # tasks are seeds: the job starts
    assert len(env.validation_tasks()) == 4
    (traj,) = _play(tok, game_class, {5: ["stop"]})
    assert traj.failed and traj.failure.startswith("reset: ") and "ConnectError" in traj.failure


def test_addresses_the_operator_has_not_allowed_are_refused_at_submission():
    settings = Settings()
    for port in (settings.gateway_port, settings.mlflow_port, settings.prefect_port):
        with pytest.raises(SpecError, match=r"^env\.url: .* is one of this service's own servers, not an environment$"):
            confine_env(settings, "alice", {"url": f"http://127.0.0.1:{port}", "protocol": "openenv"})
    with pytest.raises(SpecError, match=r"^env\.url: http://10\.0\.0\.7:8000 \(10\.0\.0\.7\) is not among the addresses .*\(OPENTINKER_ENV_URL_ALLOW\)$"):
        confine_env(settings, "alice", {"url": "http://10.0.0.7:8000", "protocol": "openenv"})  # loopback only, by default
    kept = confine_env(Settings(env_url_allow="10.0.0.0/8"), "alice", {"url": "http://10.0.0.7:8000", "protocol": "openenv"})
    assert kept["protocol"] == "openenv"
    with pytest.raises(SpecError, match="env.protocol"):
        parse_spec({"model": {"name": "tiny-random"}, "env": {"game": "envs.math:MathGame", "protocol": "openenv"}})


def test_env_serve_openenv_refuses_in_one_line():
    root = typer.Typer()
    root.add_typer(env_app, name="env")
    for args, words in ((["tests.openenv_games:Nope"], "has no 'Nope'"),
                        (["tests.openenv_games:EchoAction"], "not an OpenEnv Environment subclass"),
                        (["tests.openenv_games:EchoEnv", "--action", "tests.openenv_games:EchoObservation"],
                         "--action: EchoObservation is not an OpenEnv Action subclass"),
                        (["tests.openenv_games:PlainEnv", "--max-sessions", "2", "--action", "tests.openenv_games:EchoAction",
                          "--observation", "tests.openenv_games:EchoObservation"], "PlainEnv"),
                        (["tests.openenv_games:PlainEnv"], "cannot tell PlainEnv's Action class")):
        result = CliRunner().invoke(root, ["env", "serve", *args, "--openenv", "--open"])
        assert result.exit_code == 2 and result.output.startswith(f"cannot serve {args[0]}:"), result.output
        assert words in result.output and len(result.output.strip().splitlines()) == 1, result.output


def test_env_serve_openenv_serves_over_the_command_line():
    """`opentinker env serve --openenv` in its own process, reached by our adapter with its token."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "opentinker.cli", "env", "serve", "tests.openenv_games:GuessEnv", "--openenv",
                             "--port", str(port), "--token", TOKEN], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read().decode()[-2000:]
            time.sleep(0.2)
        game = OpenEnvGameClass(f"http://127.0.0.1:{port}", timeout_s=5, token=TOKEN)()
        assert game.reset(__seed__=7) == '{"hint": "guess a digit", "tries": 0}'
        assert game.step('{"guess": %d}' % __import__("random").Random(7).randrange(10)).reward == 1.0
        game.close()
    finally:
        proc.terminate()
        proc.wait(10)


MiB = 1024**2


class BulkyEnv(EchoEnv):
    """'big' answers 3 MB of text that compresses well, 'noise' 3 MB that does not; else it echoes."""

    def step(self, action: EchoAction, timeout_s: Optional[float] = None, **kwargs: Any) -> EchoObservation:  # type: ignore[override]
        if action.message in ("big", "noise"):
            text = "x" * 3 * MiB if action.message == "big" else base64.b64encode(os.urandom(9 * MiB // 4)).decode()
            return EchoObservation(echoed_message=text)
        return super().step(action)


def test_a_message_over_the_limit_costs_its_episode_in_one_line(tok, monkeypatch):
    """OpenEnv's WebSocket takes at most OPENTINKER_ENV_MAX_RESPONSE_BYTES a message: past it the
    connection closes (websockets checks the frame's header, and stops inflating a compressed one
    at the limit), that episode fails with the numbers, and the next one plays."""
    monkeypatch.setenv("OPENTINKER_ENV_MAX_RESPONSE_BYTES", str(MiB))
    served = Served(BulkyEnv)
    try:
        game_class = OpenEnvGameClass(served.url, timeout_s=5, retries=0, token=TOKEN)
        big, noise, fine = _play(tok, game_class, {1: ["big"], 2: ["noise"], 3: ["hello", "stop"]})
        limit = r"the answer is over the limit of OPENTINKER_ENV_MAX_RESPONSE_BYTES \(1,048,576 bytes\): "
        assert re.fullmatch(rf"step: RemoteGameError: step {served.url}: {limit}a compressed message that inflates past it", big.failure)
        assert re.fullmatch(rf"step: RemoteGameError: step {served.url}: {limit}a frame of \d,\d{{3}},\d{{3}} bytes announced", noise.failure)
        assert not fine.failed and fine.reward == 1.0
        assert episode_stats([big, noise, fine], "rollout")["rollout/failed_episodes"] == 2.0
    finally:
        served.stop()


def test_a_schema_over_the_limit_is_refused_before_it_is_read():
    from starlette.applications import Starlette
    from starlette.responses import StreamingResponse
    from starlette.routing import Route

    async def endless():
        while True:
            yield b" " * 65536
            await asyncio.sleep(0)

    served = ServedApp(lambda: Starlette(routes=[Route("/schema", lambda request: StreamingResponse(endless()))]))
    try:
        game = OpenEnvGameClass(served.url, timeout_s=5, token=TOKEN, max_response_bytes=MiB)()
        with pytest.raises(RuntimeError, match=rf"^GET {served.url}/schema: the answer is over the limit of OPENTINKER_ENV_MAX_RESPONSE_BYTES "
                                               r"\(1,048,576 bytes\): 1,\d{3},\d{3} bytes read and more coming$"):
            game.reset(__seed__=1)
    finally:
        served.stop()
