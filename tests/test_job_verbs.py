"""The job verbs on a real stack: `opentinker jobs`, `job`, `cancel` and `logs` (with `--follow`),
as a tenant through the gateway with its key, and as the operator on the stack's machine without
one (Prefect and MLflow directly). One short training job serves every reading verb; jobs parked
for `fit()` (no process starts) serve `cancel`. Another tenant's job reads exactly like a missing one.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import tiny_spec

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tenants(stack_env):
    """The stack with deployments registered and two tenants; yields (settings, key_a, key_b)."""
    from tests.stack_fixtures import deployed_tenants

    settings, _ = stack_env
    yield settings, *deployed_tenants(settings, "verbsa", "verbsb")


def _config(tmp_path, with_env: bool) -> dict:
    data = tiny_spec(tmp_path, optimization={"steps": 2}, evaluation={"every": 2, "n_samples": 8},
                     checkpoint={"every": 1}).model_dump(mode="json")
    if not with_env:
        data.pop("env")  # parked until fit(): queued, and no process starts
    return data


def _as(settings, key: str | None) -> dict[str, str | None]:
    """The environment of a tenant (key) or of the operator on the stack's machine (None)."""
    return {"OPENTINKER_API_KEY": key, "OPENTINKER_GATEWAY_URL": settings.gateway_url if key else None, "COLUMNS": "250"}


def _cli(settings, key: str | None, *args: str):
    """`opentinker ARGS` in this process (typer's CliRunner), its environment restored after."""
    from typer.testing import CliRunner

    from opentinker.cli.main import app

    saved = dict(os.environ)
    try:
        result = CliRunner().invoke(app, list(args), env=_as(settings, key))
    finally:
        os.environ.clear()
        os.environ.update(saved)
    assert not isinstance(result.exception, Exception) or isinstance(result.exception, SystemExit), result.output
    return result


@pytest.fixture(scope="module")
def finished(tenants, tmp_path_factory):
    """A two-step job of tenant a, followed from its submission to its end by `opentinker logs
    --follow` (a real process); yields (job id, what it printed)."""
    from opentinker.client import SchedulerClient

    settings, key, _ = tenants
    job_id = SchedulerClient(url=settings.gateway_url, api_key=key).submit_job(config=_config(tmp_path_factory.mktemp("j"), True))["job_id"]
    follow = subprocess.run([sys.executable, "-m", "opentinker.cli", "logs", job_id, "--follow"], cwd=ROOT, capture_output=True, text=True,
                            env={**os.environ, **{k: v for k, v in _as(settings, key).items() if v}}, timeout=600)
    assert follow.returncode == 0, follow.stdout + follow.stderr
    return job_id, follow.stdout


def test_logs_follow_prints_the_job_to_its_end(finished, tenants):
    settings, key, _ = tenants
    job_id, followed = finished
    assert "step 1/2: " in followed and "step 2/2: " in followed, followed
    assert followed.rstrip().endswith(f"job {job_id} ended: COMPLETED"), followed[-500:]
    lines = [json.loads(line) for line in _cli(settings, key, "logs", job_id, "--json").stdout.splitlines()]
    assert [line["n"] for line in lines] == list(range(len(lines))) and {"time", "level", "message", "task"} <= set(lines[0])
    assert any(line["message"].startswith("step 2/2: ") for line in lines)
    assert any((line["task"] or "").startswith(f"rollout-{job_id}-step") for line in lines)  # a task's lines name it
    printed = followed.rstrip().splitlines()[:-1]  # then the end line
    assert not any("\n" in line["message"] for line in lines)  # a job that went well: no traceback
    # follow missed nothing and repeated nothing (lines arrive out of order: the settle time)
    assert len(printed) == len(lines) and all(line["message"] in p for line, p in zip(lines, printed))
    tail = _cli(settings, key, "logs", job_id, "--offset", str(len(lines) - 1), "--json")
    assert [json.loads(line) for line in tail.stdout.splitlines()] == lines[-1:]
    plain = _cli(settings, key, "logs", job_id)
    assert plain.exit_code == 0 and "step 2/2: " in plain.stdout and f"job {job_id} ended" not in plain.stdout  # no --follow: no end line


def test_jobs_and_job_show_state_progress_checkpoints_and_links(finished, tenants):
    settings, key, _ = tenants
    job_id, _ = finished
    listed = _cli(settings, key, "jobs")
    row = next(line for line in listed.stdout.splitlines() if job_id in line)
    assert "COMPLETED" in row and "2/2" in row, listed.stdout
    entry = next(j for j in json.loads(_cli(settings, key, "jobs", "--json").stdout) if j["job_id"] == job_id)
    assert entry["state"] == "COMPLETED" and entry["step"] == 2 and entry["total_steps"] == 2 and entry["tenant"] == "verbsa"
    assert isinstance(entry["reward"], float) and isinstance(entry["accuracy"], float) and entry["started"]

    shown = _cli(settings, key, "job", job_id)
    assert shown.exit_code == 0, shown.stdout
    for text in ("COMPLETED", "step 2/2", "checkpoint step 1", "checkpoint step 2",
                 f"Prefect run: {settings.prefect_ui_url}/runs/flow-run/",
                 f"MLflow run: {settings.mlflow_url}/#/experiments/", f"checkpoint: {settings.storage_url}/tenants/verbsa/{job_id}/"):
        assert text in shown.stdout, (text, shown.stdout)
    status = json.loads(_cli(settings, key, "job", job_id, "--json").stdout)
    assert status["state"] == "COMPLETED" and status["step"] == 2 and status["accuracy_step"] == 2
    assert [(c["step"], c["valid"]) for c in status["checkpoints"]] == [(1, True), (2, True)]
    assert set(status["links"]) == {"prefect", "mlflow"}

    ended = _cli(settings, key, "cancel", job_id)
    assert ended.exit_code == 1 and ended.stdout == f"job {job_id} already ended (COMPLETED)\n"


def test_another_tenants_job_reads_like_a_missing_one(finished, tenants):
    settings, _, key_b = tenants
    job_id, _ = finished
    missing = "verbsb-nosuchjob"
    for verb in (["job"], ["job", "--json"], ["logs"], ["logs", "--follow"], ["cancel"], ["cancel", "--json"]):
        theirs, none = _cli(settings, key_b, *verb[:1], job_id, *verb[1:]), _cli(settings, key_b, *verb[:1], missing, *verb[1:])
        assert (theirs.exit_code, theirs.stdout) == (2, f"no job {job_id!r}\n"), (verb, theirs.stdout)
        assert (none.exit_code, none.stdout) == (2, f"no job {missing!r}\n"), (verb, none.stdout)
    assert job_id not in _cli(settings, key_b, "jobs", "--json").stdout
    assert _cli(settings, key_b, "job", "../x").stdout.startswith("JOB '../x': contains a path separator")


def test_the_operator_sees_the_same_job_without_a_key(finished, tenants):
    """No key: the local stack's Prefect and MLflow, every tenant's jobs, the same fields."""
    settings, key, _ = tenants
    job_id, _ = finished
    listed = _cli(settings, None, "jobs")
    row = next(line for line in listed.stdout.splitlines() if job_id in line)
    assert "verbsa" in row and "COMPLETED" in row and "2/2" in row, listed.stdout
    mine, theirs = (json.loads(_cli(settings, k, "job", job_id, "--json").stdout) for k in (key, None))
    same = ("job_id", "tenant", "state", "step", "total_steps", "reward", "accuracy", "started", "links", "checkpoint", "checkpoints")
    assert {k: theirs[k] for k in same} == {k: mine[k] for k in same}
    # The same lines in the same order; the operator's whole, the tenant's without the operator's folders
    # ("Downloading flow code from storage at '<tmp>/…'"; tenant_logs.py, tests/test_tenant_logs.py).
    from opentinker.control.gateway.tenant_logs import operator_folders, tenant_message

    whole, tenants = ([json.loads(line) for line in _cli(settings, k, "logs", job_id, "--json").stdout.splitlines()] for k in (None, key))
    assert [line | {"message": None} for line in whole] == [line | {"message": None} for line in tenants]
    assert [tenant_message(line["message"], operator_folders(settings)) for line in whole] == [line["message"] for line in tenants]
    assert any(str(settings.state_dir) in line["message"] or "/tmp/" in line["message"] for line in whole)
    missing = _cli(settings, None, "logs", "nosuchjob")
    assert (missing.exit_code, missing.stdout) == (2, "no job 'nosuchjob'\n")


def test_cancel_a_queued_job_through_the_gateway_and_as_the_operator(tenants, tmp_path):
    from opentinker.client import SchedulerClient

    settings, key, key_b = tenants
    client = SchedulerClient(url=settings.gateway_url, api_key=key)
    first, second = (client.submit_job(config=_config(tmp_path, False))["job_id"] for _ in range(2))
    assert _cli(settings, key_b, "cancel", first).exit_code == 2
    assert client.job_status(first)["state"] == "QUEUED"  # the other tenant's cancel touched nothing
    out = _cli(settings, key, "cancel", first)
    assert (out.exit_code, out.stdout) == (0, f"job {first}: CANCELLED (cancelled while queued)\n")
    as_operator = json.loads(_cli(settings, None, "cancel", second, "--json").stdout)
    assert as_operator["job_id"] == second and as_operator["state"] == "CANCELLED" and as_operator["tenant"] == "verbsa"
    assert client.job_status(second)["state"] == "CANCELLED"


def test_the_logs_endpoint_pages_within_bounds_and_only_for_the_owner(finished, tenants):
    """The endpoint `logs --follow` polls: an offset cursor, at most 200 lines a page; a bad
    cursor is one line (422), another tenant's job a 404, no key a 401."""
    import httpx

    from opentinker.client import SchedulerClient

    settings, key, key_b = tenants
    job_id, _ = finished
    url = f"{settings.gateway_url}/v1/jobs/{job_id}/logs"
    page = SchedulerClient(url=settings.gateway_url, api_key=key).logs(job_id, offset=1, limit=2)
    assert (page["offset"], page["next_offset"], len(page["lines"]), page["state"], page["complete"]) == (1, 3, 2, "COMPLETED", True)
    for query, field in (("offset=-1", "offset"), ("limit=0", "limit"), ("limit=201", "limit"), (f"offset={10**12}", "offset")):
        answer = httpx.get(f"{url}?{query}", headers={"Authorization": f"Bearer {key}"})
        assert answer.status_code == 422 and answer.json()["detail"].startswith(f"{field}: "), (query, answer.text)
    assert httpx.get(url, headers={"Authorization": f"Bearer {key_b}"}).json() == {"detail": f"no job {job_id!r}"}
    assert httpx.get(url).status_code == 401
