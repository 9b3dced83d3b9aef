"""`opentinker sandbox`'s service, driven by SandboxFusion's own unmodified client (sandbox-fusion
0.3.7): the key as a path prefix in its endpoint, stdout, a timeout, a non-zero exit, files in and
out, a language it does not run; 401 without the key or with a wrong one; 413 for a body over
1 MiB; 32 concurrent calls all answered. Skipped only where bwrap is absent."""

from __future__ import annotations

import base64
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from opentinker.tools.sandbox import Sandbox, SandboxLimits

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("bubblewrap")]
sandbox_fusion = pytest.importorskip("sandbox_fusion")


@pytest.fixture(scope="module")
def service():
    from opentinker.tools.sandbox_service import new_key, serve_in_thread

    running = serve_in_thread(Sandbox(SandboxLimits()), new_key(), "127.0.0.1", 0)
    yield running
    running.stop()


def run(service, **fields):
    from sandbox_fusion import RunCodeRequest, run_code

    return run_code(RunCodeRequest(**{"language": "python", **fields}), endpoint=service.endpoint, max_attempts=1, client_timeout=60)


def test_stdout_through_the_unmodified_client(service):
    response = run(service, code="import sys\nprint(sys.stdin.read().upper())", stdin="hello")
    assert response.status == "Success" and response.message == "" and response.compile_result is None
    assert response.run_result.status == "Finished" and response.run_result.return_code == 0
    assert response.run_result.stdout == "HELLO\n" and response.run_result.stderr == ""
    assert 0 < response.run_result.execution_time < 5


def test_global_endpoint_setting_works_too(service):
    from sandbox_fusion import RunCodeRequest, run_code, set_sandbox_endpoint

    set_sandbox_endpoint(service.endpoint + "/")  # the client trims the slash
    assert run_code(RunCodeRequest(code="print(6 * 7)", language="python"), max_attempts=1).run_result.stdout == "42\n"


def test_timeout_and_non_zero_exit(service):
    from sandbox_fusion import SummaryMapping, summary_run_code_result

    slow = run(service, code="import time\ntime.sleep(30)", run_timeout=1)
    assert slow.status == "Failed" and slow.run_result.status == "TimeLimitExceeded" and slow.run_result.execution_time < 3
    assert summary_run_code_result(slow, SummaryMapping(RunTimeout="timeout")) == "timeout"
    failing = run(service, code="import sys\nprint('out')\nsys.exit(3)")
    assert failing.status == "Failed" and failing.run_result.status == "Finished" and failing.run_result.return_code == 3
    assert failing.run_result.stdout == "out\n" and "3" in failing.message
    raising = run(service, code="raise ValueError('boom')")
    assert raising.run_result.return_code == 1 and "ValueError: boom" in raising.run_result.stderr


def test_files_in_and_out_and_python3_alias(service):
    files = {"helper.py": base64.b64encode(b"VALUE = 41").decode(), "data/in.txt": base64.b64encode(b"abc").decode()}
    code = "import helper\nopen('out.bin', 'wb').write(open('data/in.txt', 'rb').read() * 2)\nprint(helper.VALUE + 1)"
    response = httpx.post(f"{service.endpoint}/run_code", timeout=30,
                          json={"code": code, "language": "python3", "files": files, "fetch_files": ["out.bin", "missing"]})
    body = response.json()
    assert body["status"] == "Success" and body["run_result"]["stdout"] == "42\n"
    assert body["files"] == {"out.bin": base64.b64encode(b"abcabc").decode()}


def test_memory_limit_field(service):
    response = httpx.post(f"{service.endpoint}/run_code", timeout=30,
                          json={"code": "x = bytearray(300 * 1024 ** 2)\nprint('ok')", "language": "python", "memory_limit_MB": 128})
    assert response.json()["run_result"]["return_code"] == 1 and "MemoryError" in response.json()["run_result"]["stderr"]


def test_other_languages_fail_clearly(service):
    response = run(service, code="int main() { return 0; }", language="cpp")
    assert response.status == "Failed" and "'cpp' is not supported" in response.message and response.run_result is None


def test_the_key_is_required(service):
    body = {"code": "print(1)", "language": "python"}
    assert httpx.post(f"{service.url}/run_code", json=body).status_code == 401
    assert httpx.post(f"{service.url}/k/wrong-key/run_code", json=body).status_code == 401
    assert httpx.post(f"{service.url}/run_code", json=body, headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert httpx.post(f"{service.url}/k//run_code", json=body).status_code == 401
    assert httpx.get(f"{service.url}/v1/ping").status_code == 401
    good = httpx.post(f"{service.url}/run_code", json=body, headers={"Authorization": f"Bearer {service.key}"})
    assert good.status_code == 200 and good.json()["run_result"]["stdout"] == "1\n"
    assert httpx.get(f"{service.endpoint}/v1/ping").json() == "pong"
    from sandbox_fusion import RunCodeRequest, run_code

    with pytest.raises(Exception, match="401"):
        run_code(RunCodeRequest(code="print(1)", language="python"), endpoint=f"{service.url}/k/not-the-key", max_attempts=1)


def test_a_body_over_1_mib_is_refused(service):
    big = {"code": "#" + "x" * (1 << 20), "language": "python"}
    assert httpx.post(f"{service.endpoint}/run_code", json=big, timeout=30).status_code == 413
    assert run(service, code="print(1)").run_result.stdout == "1\n"


def test_32_concurrent_calls_all_answered(service):
    with ThreadPoolExecutor(32) as pool:
        responses = list(pool.map(lambda i: run(service, code=f"print({i} * {i})"), range(32)))
    assert [r.run_result.stdout for r in responses] == [f"{i * i}\n" for i in range(32)]
    assert all(r.status == "Success" for r in responses)


def test_cli_refuses_without_bwrap(monkeypatch):
    from typer.testing import CliRunner

    import opentinker.tools.sandbox as sandbox_module
    from opentinker.cli.main import app

    monkeypatch.setattr(sandbox_module.shutil, "which", lambda name: None)
    monkeypatch.setattr(sandbox_module, "BWRAP", "/nonexistent/bwrap")
    result = CliRunner().invoke(app, ["sandbox", "--port", "0"])
    assert result.exit_code == 1
    assert "needs bubblewrap (Debian package: bubblewrap)" in result.output and len(result.output.strip().splitlines()) == 1
