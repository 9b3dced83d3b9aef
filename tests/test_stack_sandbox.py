"""The stack's sandbox service (SandboxFusion's `/run_code`, tools/sandbox_service.py) on the session's
stack: it answers the unmodified `sandbox_fusion` client at the endpoint with its key, and 401 without
it; its key is in an owner-only file of the state folder, named (never shown) by its command line, its
log and `opentinker status`. Where bubblewrap does not run the stack leaves it out and says so in one
line naming the Debian package (checked without bwrap too, on a stack that is not running)."""

from __future__ import annotations

import os
import stat

import httpx
import psutil
import pytest
from typer.testing import CliRunner

from opentinker.control import services
from opentinker.control.services import sandbox_endpoint, sandbox_key_file, sandbox_unavailable, services_for
from opentinker.core.settings import settings_env

pytestmark = pytest.mark.timeout(300)


def _status_output(env: dict[str, str]) -> str:
    """`opentinker status` in this process with `env`; the variables it exports for its clients are undone."""
    from opentinker.cli.main import app

    saved = dict(os.environ)
    try:
        shown = CliRunner().invoke(app, ["status"], env={**env, "COLUMNS": "250"})
    finally:
        os.environ.clear()
        os.environ.update(saved)
    assert shown.exit_code == 0, shown.output
    return shown.output


@pytest.fixture(scope="module")
def sandbox(stack):
    """(settings, key) of the session stack's sandbox service; skipped where bubblewrap does not run."""
    if why := sandbox_unavailable():
        pytest.skip(f"the stack leaves its sandbox service out here: {why}")
    settings, status = stack
    assert status["sandbox"].running and status["sandbox"].healthy, status["sandbox"]
    return settings, sandbox_key_file(settings).read_text().strip()


def test_the_stacks_sandbox_answers_the_unmodified_client_with_its_key_and_401_without(sandbox):
    from sandbox_fusion import RunCodeRequest, run_code

    settings, key = sandbox
    base = f"http://127.0.0.1:{settings.sandbox_port}"
    response = run_code(RunCodeRequest(code="print(6 * 7)", language="python"), endpoint=f"{base}/k/{key}",
                        max_attempts=1, client_timeout=60)
    assert response.status == "Success" and response.run_result.stdout == "42\n", response
    with pytest.raises(Exception, match="401"):
        run_code(RunCodeRequest(code="print(1)", language="python"), endpoint=f"{base}/k/not-the-key", max_attempts=1)
    assert httpx.post(f"{base}/run_code", json={"code": "print(1)"}, timeout=30, trust_env=False).status_code == 401
    answer = httpx.post(f"{base}/run_code", json={"code": "print(2)"}, headers={"Authorization": f"Bearer {key}"},
                        timeout=60, trust_env=False)
    assert answer.status_code == 200 and answer.json()["run_result"]["stdout"] == "2\n"


def test_its_key_is_an_owner_only_file_that_is_named_never_shown(sandbox):
    settings, key = sandbox
    path = sandbox_key_file(settings)
    assert path.parent == settings.state_dir and stat.S_IMODE(path.stat().st_mode) == 0o600 and len(key) >= 32
    service = psutil.Process(int((settings.state_dir / "pids" / "sandbox.pid").read_text()))
    assert key not in " ".join(service.cmdline()) and str(path) in service.cmdline()
    assert [c.laddr.ip for c in service.net_connections("tcp") if c.status == psutil.CONN_LISTEN] == ["127.0.0.1"]
    assert key not in (settings.state_dir / "logs" / "sandbox.log").read_text()
    assert sandbox_endpoint(settings) == f"http://127.0.0.1:{settings.sandbox_port}/k/$(cat {path})"
    shown = _status_output(settings_env(settings))
    assert key not in shown and f"http://127.0.0.1:{settings.sandbox_port}/k/$(cat {path})" in shown, shown


def test_without_bubblewrap_the_stack_leaves_it_out_in_one_line(tmp_path, monkeypatch):
    from tests.stack_fixtures import local_settings

    why = "it needs bubblewrap (Debian package: bubblewrap): /usr/bin/bwrap not found; apt-get install bubblewrap"
    monkeypatch.setattr(services, "sandbox_unavailable", lambda: why)
    settings = local_settings(tmp_path)
    assert "sandbox" not in services_for(settings) and "gateway" in services_for(settings)
    shown = _status_output(settings_env(settings))
    assert [line for line in shown.splitlines() if "sandbox" in line] == [f"sandbox service: not started: {why}"], shown
    assert not (tmp_path / "sandbox-key").exists()
