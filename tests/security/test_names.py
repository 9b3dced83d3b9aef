"""Names as attacks: job ids that would write outside the runs folder, tenant names that are not
what they look like, and a tenant that must be removable.

Each attack is attempted for real: the `opentinker` command in a subprocess (or typer's runner
where argv cannot carry the byte, a NUL), real files in a temporary folder (every test checks that
the folder holds afterwards exactly what it held before), the real tenant store, a real gateway.
The last tests run against the session's stack: a flow run made straight on Prefect (past the CLI
and the gateway) with `../../x` is refused by the stack's own worker; `tenant remove` lists the
jobs it leaves behind.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.conftest import tiny_spec

pytestmark = pytest.mark.timeout(900)
ROOT = Path(__file__).resolve().parents[2]
# `../../x` from <tmp>/a/b/runs lands in <tmp>/a/x: outside the runs folder, inside the test's own
BAD_IDS = ["../../x", "../x", "a/../../x", "a/b", "/tmp/x", "x\ny", "zed\n", "x\ty", "..", ".", ".hidden", "-x", "x y", "a" * 65]
GOOD_IDS = ["x", "try1", "job-20261123-194501-1a2b3c", "acme-math.v2_b", "a..b", "a" * 64]


def _cli(*args: str, env: dict[str, str] | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "opentinker.cli", *args], cwd=ROOT, env=os.environ | (env or {}),
                          capture_output=True, text=True, timeout=timeout, check=False)


def _lines(out) -> list[str]:
    """The non-empty lines a user sees."""
    text = out.stdout + (out.stderr if isinstance(getattr(out, "stderr", None), str) else "")
    return [line for line in text.splitlines() if line.strip()]


def _tree(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


def _spec_file(tmp_path: Path) -> Path:
    """A spec that trains one step of the tiny model and checkpoints to <tmp>/a/b/runs."""
    spec = tmp_path / "spec.yaml"
    spec.write_text(json.dumps(tiny_spec(tmp_path, optimization={"steps": 1}, checkpoint={"every": 1, "base_url": f"file://{tmp_path}/a/b/runs"},
                                         evaluation={"every": 0, "n_samples": 8}).model_dump(mode="json", exclude_none=True)))
    return spec


@pytest.fixture
def restored_environ():
    """The CLI exports the stack's variables into os.environ; typer's runner would leak them."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


# --- one rule for job ids, the gateway's ------------------------------------------------------

@pytest.mark.parametrize("job_id", BAD_IDS + GOOD_IDS + ["x\x00y", "x\r", "é", "x\u200by", "a'b", "a\\b"])
def test_the_shared_rule_is_the_gateways(tmp_path, job_id):
    """check_job_id accepts exactly what JobSpec.job_id (the gateway's check) accepts."""
    from opentinker.core.ids import InvalidJobId, check_job_id
    from opentinker.core.spec import SpecError

    try:
        tiny_spec(tmp_path, job_id=job_id)
        spec_ok = True
    except SpecError as err:
        assert str(err).startswith("job_id:"), err
        spec_ok = False
    try:
        check_job_id(job_id, "--job-id")
        ours_ok = True
    except InvalidJobId as err:
        assert "\n" not in str(err) and str(err).startswith("--job-id "), err
        ours_ok = False
    assert ours_ok == spec_ok == (job_id in GOOD_IDS)


# --- the CLI ----------------------------------------------------------------------------------

@pytest.mark.parametrize("command", ["run", "train"])
@pytest.mark.parametrize("job_id", ["../../x", "a/b", "x\ny"])
def test_run_and_train_refuse_a_bad_job_id_before_writing_anything(tmp_path, command, job_id):
    spec = _spec_file(tmp_path)
    before = _tree(tmp_path)
    out = _cli(command, str(spec), "--job-id", job_id, env={"OPENTINKER_STATE_DIR": str(tmp_path / "state")})
    assert out.returncode == 2, out
    lines = _lines(out)
    assert len(lines) == 1 and lines[0].startswith(f"--job-id {job_id!r}: "), lines
    assert ("path separator" if "/" in job_id else "control or invisible character '\\n'") in lines[0]
    assert _tree(tmp_path) == before  # no runs folder, no ../../x, no state folder: the stack never started


@pytest.mark.parametrize("argv", [["run", "SPEC"], ["train", "SPEC"], ["sft", "SPEC", "--local"], ["sft", "SPEC"], ["follow"]])
def test_a_nul_in_a_job_id_is_one_line_from_every_command(tmp_path, restored_environ, argv):
    """argv cannot carry a NUL (exec refuses it): typer's runner passes it to the commands."""
    from typer.testing import CliRunner

    from opentinker.cli.main import app

    spec = _spec_file(tmp_path)
    before = _tree(tmp_path)
    args = [str(spec) if a == "SPEC" else a for a in argv]
    args += ["x\x00y"] if argv == ["follow"] else ["--job-id", "../x\x00"]
    result = CliRunner().invoke(app, args, env={"OPENTINKER_STATE_DIR": str(tmp_path / "state"), "COLUMNS": "200"})
    assert result.exit_code == 2, result.output
    lines = _lines(result)
    what = "JOB_ID 'x\\x00y'" if argv == ["follow"] else "--job-id '../x\\x00'"
    assert len(lines) == 1 and lines[0].startswith(f"{what}: contains the control or invisible character '\\x00'"), lines
    assert _tree(tmp_path) == before


def test_run_with_a_good_job_id_writes_only_under_its_folder(tmp_path):
    """The control for the attacks above: the same command and spec with a good id checkpoints to
    <runs>/<id>/ and nowhere else."""
    spec = _spec_file(tmp_path)
    out = _cli("run", str(spec), "--job-id", "good-1", env={"OPENTINKER_STATE_DIR": str(tmp_path / "state")})
    assert out.returncode == 0, out.stdout + out.stderr
    assert (tmp_path / "a/b/runs/good-1/step-00000001/COMMIT.json").is_file()
    outside = {p for p in _tree(tmp_path) if not p.startswith(("a/b/runs/good-1", "state"))}
    assert outside == {"spec.yaml", "a", "a/b", "a/b/runs"}, outside


# --- the Python entry points ------------------------------------------------------------------

def test_python_entry_points_refuse_a_bad_job_id_before_writing_anything(tmp_path):
    import torch

    from opentinker.control.submit import submit_job
    from opentinker.core.ids import InvalidJobId
    from opentinker.core.settings import Settings
    from opentinker.inference.pipeline import run_inference
    from opentinker.orchestration.job import scheduled_job
    from opentinker.rl import Policy, RLJob
    from opentinker.storage import checkpoint as ckpt

    spec = tiny_spec(tmp_path, checkpoint={"base_url": f"file://{tmp_path}/a/b/runs"})
    base = spec.checkpoint.base_url
    data = tmp_path / "tasks.jsonl"
    data.write_text('{"question": "q"}\n')
    before = _tree(tmp_path)
    attempts = {
        "RLJob": lambda j: RLJob(spec, job_id=j),
        "Policy": lambda j: Policy(spec, job_id=j),
        "scheduled_job": lambda j: scheduled_job(spec, j, None).__enter__(),  # the flows' first step
        "submit_job": lambda j: submit_job(spec.model_dump(mode="json"), j, Settings(state_dir=tmp_path / "state")),
        "run_inference": lambda j: run_inference("http://127.0.0.1:9", str(data), "envs.toy:UppercaseGame", job_id=j, log_to_mlflow=False),
        "save_checkpoint": lambda j: ckpt.save_checkpoint(base, j, 1, {"w": torch.zeros(1)}, {"state": {}, "param_groups": []}, {}),
        "latest_checkpoint": lambda j: ckpt.latest_checkpoint(base, j),
    }
    for name, attempt in attempts.items():
        for job_id in ("../../x", "..", "a/b", "x\x00", "x\n"):
            with pytest.raises(InvalidJobId) as caught:
                attempt(job_id)
            assert "\n" not in str(caught.value), (name, caught.value)
    assert _tree(tmp_path) == before


def test_the_serving_flow_refuses_a_bad_job_id(tmp_path):
    """serve-model names a temporary folder after its job id (`opentinker-serve-<id>-…`)."""
    from flows.inference import serve_model
    from opentinker.core.ids import InvalidJobId
    from opentinker.inference.spec import InferenceSpec

    with pytest.raises(InvalidJobId, match="job_id '../../x': contains a path separator"):
        serve_model.fn(InferenceSpec(model_path=str(tmp_path / "nothing")), job_id="../../x")


def test_sft_and_self_play_jobs_refuse_bad_ids_and_player_names(tmp_path):
    import yaml

    from opentinker.core.ids import InvalidJobId
    from opentinker.core.spec import parse_spec
    from opentinker.rl.selfplay import SelfPlayJob
    from opentinker.sft.job import SFTJob
    from opentinker.sft.spec import parse_sft_spec

    chats = tmp_path / "chats.jsonl"
    chats.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}) + "\n")
    sft = parse_sft_spec({"model": {"name": "tiny-random"}, "data": {"path": str(chats)},
                          "storage": {"base_url": f"file://{tmp_path}/a/b/runs"}})
    play = yaml.safe_load((ROOT / "examples/gomoku_selfplay.yaml").read_text())
    play["model"] = {"name": "tiny-random"}
    play["rollout"]["max_total_tokens"] = 1024  # the tiny model's context (the example's 4096 is SmolLM2's to give)
    play["checkpoint"]["base_url"] = f"file://{tmp_path}/a/b/runs"
    before = _tree(tmp_path)
    with pytest.raises(InvalidJobId, match=r"job_id '\.\./\.\./x': contains a path separator"):
        SFTJob(sft, "../../x")
    with pytest.raises(InvalidJobId, match=r"job_id 'x\\n': contains the control or invisible character"):
        SelfPlayJob(parse_spec(play), "x\n")
    # a player's checkpoints go to <job_id>.<player>/: `../../p` would climb out of the runs folder
    play["multiagent"]["players"] = ["X", "../../p"]
    with pytest.raises(InvalidJobId, match=r"multiagent.players: player '\.\./\.\./p': contains a path separator"):
        SelfPlayJob(parse_spec(play), "sp")
    assert _tree(tmp_path) == before


# --- tenant names, matched whole --------------------------------------------------------------

@pytest.mark.parametrize("name", ["zed\n", "zed\r\n", "\nzed", "zed\x00", "zed ", " zed", "zé", "Zed", "zed-corp", "z"])
def test_tenant_names_are_matched_whole(tmp_path, name):
    from opentinker.control.gateway.tenants import TenantStore

    store = TenantStore(tmp_path / "tenants.json")
    with pytest.raises(ValueError, match="tenant name") as caught:
        store.create(name)
    assert "\n" not in str(caught.value)
    assert store.names() == []


def test_tenant_add_with_a_trailing_newline_is_one_line(tmp_path):
    out = _cli("tenant", "add", "zed\n", env={"OPENTINKER_STATE_DIR": str(tmp_path)})
    assert out.returncode == 2, out
    assert _lines(out) == ["tenant name 'zed\\n': must be 2-32 lowercase letters and digits, starting with a letter"]
    assert not (tmp_path / "tenants.json").exists()


def test_a_stored_name_an_older_version_let_in_is_no_tenant_and_can_be_removed(tmp_path):
    from opentinker.control.gateway.tenants import TenantStore

    key = "tml-" + "k" * 43
    (tmp_path / "tenants.json").write_text(json.dumps({"zed\n": {"key_sha256": hashlib.sha256(key.encode()).hexdigest(), "created": "x"}}))
    assert TenantStore(tmp_path / "tenants.json").authenticate(key) is None
    env = {"OPENTINKER_STATE_DIR": str(tmp_path), "OPENTINKER_PREFECT_PORT": "9"}  # no Prefect there: jobs not checked
    listed = _cli("tenant", "list", env=env)
    assert _lines(listed) == ["'zed\\n' (not a valid name, its key is refused: opentinker tenant remove 'zed\\n')"]
    removed = _cli("tenant", "remove", "zed\n", env=env)
    assert removed.returncode == 0, removed
    assert _lines(removed)[0] == "tenant 'zed\\n' removed: its API key no longer authenticates"
    assert json.loads((tmp_path / "tenants.json").read_text()) == {}


# --- tenant remove ----------------------------------------------------------------------------

def _key_from(out) -> str:
    assert out.returncode == 0, out
    return _lines(out)[-1]


def _answers(gateway: str, key: str) -> tuple[int, int]:
    """Status codes of the native door (/v1/whoami) and the Tinker door (/api/v1/client/config)."""
    return (httpx.get(f"{gateway}/v1/whoami", headers={"Authorization": f"Bearer {key}"}, timeout=30).status_code,
            httpx.post(f"{gateway}/api/v1/client/config", headers={"X-API-Key": key}, json={}, timeout=30).status_code)


def test_tenant_remove_revokes_the_key_on_both_doors_at_once(tmp_path):
    from opentinker.control.gateway.app import create_app
    from opentinker.core.settings import Settings
    from opentinker.inference.server import serve_in_thread

    env = {"OPENTINKER_STATE_DIR": str(tmp_path / "state"), "OPENTINKER_PREFECT_PORT": "9"}
    leaver, stayer = _key_from(_cli("tenant", "add", "leaver", env=env)), _key_from(_cli("tenant", "add", "stayer", env=env))
    gateway = serve_in_thread(create_app(Settings(state_dir=tmp_path / "state")), "127.0.0.1")  # a running gateway: no restart
    try:
        assert _answers(gateway.url, leaver) == (200, 200) and _answers(gateway.url, stayer) == (200, 200)
        out = _cli("tenant", "remove", "leaver", env=env)
        assert out.returncode == 0, out
        lines = _lines(out)
        assert lines[0] == "tenant 'leaver' removed: its API key no longer authenticates"
        assert lines[1].startswith("jobs: not checked (the Prefect server at http://127.0.0.1:9 does not answer); none is cancelled")
        assert lines[2].startswith(f"data: left in place (file://{tmp_path}/state/storage/tenants/leaver, MLflow experiment leaver")
        assert _answers(gateway.url, leaver) == (401, 401)
        assert _answers(gateway.url, stayer) == (200, 200)
    finally:
        gateway.stop()
    assert _lines(_cli("tenant", "list", env=env)) == ["stayer"]
    again = _cli("tenant", "remove", "leaver", env=env)
    assert again.returncode == 2 and _lines(again) == ["tenant 'leaver': no such tenant (`opentinker tenant list` names them)"]
    assert "not cancelled" in " ".join(_cli("tenant", "remove", "--help", env=env).stdout.split())


# --- on the stack: its worker, and the jobs a removed tenant leaves ---------------------------

@pytest.fixture(scope="module")
def deployed(stack_env):
    from opentinker.control.submit import deploy

    settings, env = stack_env
    deploy(settings)
    return settings, env


def _final(flow_run_id, timeout: float = 300.0):
    from opentinker.control.scheduler import job_state, prefect_client
    from opentinker.core.states import TERMINAL

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with prefect_client() as client:
            run = client.read_flow_run(flow_run_id)
        state, _ = job_state(run)
        if state in TERMINAL:
            return run, state
        time.sleep(2)
    raise AssertionError(f"flow run {flow_run_id} did not end in {timeout}s")


def test_the_stacks_worker_refuses_a_job_id_that_climbs_out(deployed, tmp_path):
    """Straight to Prefect (what an attacker on the private side, or a bug past the CLI and the
    gateway, could do): the worker's flow refuses `../../x` before it writes anything."""
    from prefect.deployments import run_deployment

    from opentinker.control.scheduler import deployment_name, flow_for

    params = tiny_spec(tmp_path, optimization={"steps": 1}, checkpoint={"every": 1, "base_url": f"file://{tmp_path}/a/b/runs"}).model_dump(mode="json")
    before = _tree(tmp_path)
    run = run_deployment(deployment_name(flow_for(params), "cpu"), parameters={"spec": params, "job_id": "../../x"}, timeout=0,
                         tags=["opentinker", "job:names-attack"])
    run, state = _final(run.id)
    assert state == "FAILED", run.state
    assert "job_id '../../x': contains a path separator" in (run.state.message or ""), run.state.message
    assert _tree(tmp_path) == before


def test_tenant_remove_lists_the_jobs_it_leaves_and_the_gateway_then_answers_401(deployed, tmp_path):
    from opentinker.control.gateway.jobs import TenantJobs
    from opentinker.core.settings import prefect_env, settings_env

    settings, _ = deployed
    env = settings_env(settings) | prefect_env(settings)
    key = _key_from(_cli("tenant", "add", "quitter", "--rotate", env=env))
    config = tiny_spec(tmp_path).model_dump(mode="json")
    config.pop("env")  # parked until fit() gives its game: queued, never runs
    submitted = httpx.post(f"{settings.gateway_url}/v1/jobs", headers={"Authorization": f"Bearer {key}"}, json={"config": config}, timeout=60)
    assert submitted.status_code == 201, submitted.text
    job_id = submitted.json()["job_id"]
    try:
        out = _cli("tenant", "remove", "quitter", env=env)
        assert out.returncode == 0, out
        lines = _lines(out)
        assert lines[0] == "tenant 'quitter' removed: its API key no longer authenticates"
        assert lines[1] == (f"jobs: 1 still queued or running, not cancelled: {job_id}; "
                            f"cancel them in the Prefect UI ({settings.prefect_ui_url}, tag tenant:quitter)")
        assert httpx.get(f"{settings.gateway_url}/v1/jobs/{job_id}", headers={"Authorization": f"Bearer {key}"}, timeout=30).status_code == 401
        assert [j["state"] for j in TenantJobs(settings, "quitter").list()] == ["QUEUED"]  # left for the operator, as the help says
    finally:
        TenantJobs(settings, "quitter").cancel(job_id)
