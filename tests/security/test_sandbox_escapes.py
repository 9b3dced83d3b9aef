"""Hostile code through `Sandbox.run`, each escape really attempted: a fork bomb, a memory bomb, an
endless loop, 100 MB of output, reading the checkout, the home folder, the state folder and the
host's /tmp and /dev/shm, connecting to a port the test listens on, writing outside its working
folder, a symlink out of it, a child that outlives the call, the host's /proc and our environment.

Each test asserts the attempt is contained (the secret never appears, nothing is created, no
process is left) and that the next run still answers `print(1)`. Skipped only where bwrap is absent.
"""

from __future__ import annotations

import os
import secrets
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from opentinker.tools.sandbox import Sandbox, SandboxLimits, python_tool

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("bubblewrap")]

ROOT = Path(__file__).resolve().parents[2]
SECRET = f"otk-secret-{secrets.token_hex(8)}"
WALL_S = 3.0


@pytest.fixture(scope="module")
def sandbox() -> Sandbox:
    return Sandbox(SandboxLimits(wall_s=WALL_S, cpu_s=5, max_running=4))


def still_works(sandbox: Sandbox) -> None:
    result = sandbox.run("print(1)")
    assert (result.status, result.return_code, result.stdout) == ("Finished", 0, "1\n"), result


def host_processes_with(marker: str) -> list[int]:
    """Host pids whose name or command line holds `marker`."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            text = Path(f"/proc/{entry}/cmdline").read_bytes() + Path(f"/proc/{entry}/comm").read_bytes()
        except OSError:
            continue
        if marker.encode() in text:
            found.append(int(entry))
    return found


def gone(marker: str, within_s: float = 2.0) -> bool:
    deadline = time.monotonic() + within_s
    while host_processes_with(marker):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


NAME = "import ctypes; ctypes.CDLL(None).prctl(15, {!r}.encode(), 0, 0, 0)\n"  # PR_SET_NAME: our marker in /proc/<pid>/comm


def test_fork_bomb_is_capped_and_leaves_nothing(sandbox):
    marker = f"bomb{secrets.token_hex(4)}"
    code = NAME.format(marker) + (
        "import os\nn = 0\nwhile True:\n    try:\n        if os.fork() == 0:\n            n = 0\n        else:\n            n += 1\n"
        "    except OSError:\n        pass\n")
    seen: list[int] = []
    watcher = threading.Thread(target=lambda: [seen.append(len(host_processes_with(marker))) or time.sleep(0.2) for _ in range(10)])
    watcher.start()
    result = sandbox.run(code)
    watcher.join()
    assert result.status == "TimeLimitExceeded" and result.wall_s < WALL_S + 2
    assert max(seen) <= sandbox.limits.processes, f"{max(seen)} processes of the bomb on the host"
    assert gone(marker), "the fork bomb's processes outlived the run"
    still_works(sandbox)


@pytest.mark.parametrize("code", ["x = bytearray(10 * 1024 ** 3)\n",
                                  "chunks = []\nwhile True:\n    chunks.append(bytearray(256 * 1024 ** 2))\n"])
def test_memory_bomb_fails_inside(sandbox, code):
    result = sandbox.run(code)
    assert result.status == "Finished" and result.return_code != 0 and "MemoryError" in result.stderr, result
    still_works(sandbox)


def test_endless_loop_is_killed_at_the_wall_limit_with_its_group(sandbox):
    marker = f"loop{secrets.token_hex(4)}"
    code = NAME.format(marker) + "import os\nos.fork()\nos.fork()\nwhile True:\n    pass\n"
    started = time.monotonic()
    result = sandbox.run(code)
    assert result.status == "TimeLimitExceeded" and result.return_code is None
    assert WALL_S - 0.1 <= time.monotonic() - started < WALL_S + 2
    assert gone(marker), "a looping process outlived the run"
    still_works(sandbox)


def test_cpu_limit(sandbox):
    limited = Sandbox(SandboxLimits(wall_s=10, cpu_s=1, max_running=4))
    result = limited.run("while True:\n    pass\n")
    assert result.status == "TimeLimitExceeded" and result.wall_s < 5, result
    still_works(limited)


def test_100_mb_of_output_is_capped(sandbox):
    result = sandbox.run("import sys\nsys.stdout.buffer.write(b'x' * 100_000_000)\nsys.stderr.buffer.write(b'y' * 10_000_000)\n")
    assert result.status == "Finished" and result.return_code == 0
    assert result.stdout_truncated and len(result.stdout) == sandbox.limits.output_bytes
    assert result.stderr_truncated and len(result.stderr) == sandbox.limits.output_bytes
    endless = sandbox.run("import sys\nwhile True:\n    sys.stdout.write('z' * 65536)\n")
    assert endless.status == "TimeLimitExceeded" and len(endless.stdout) == sandbox.limits.output_bytes
    text = python_tool(sandbox).run({"code": "print('x' * 10**6)"})
    assert len(text) < sandbox.limits.output_bytes + 200 and "truncated" in text
    still_works(sandbox)


@pytest.fixture
def planted():
    """The secret in files the sandbox must not see: the checkout, the home folder and its state
    folder, the host's /tmp and /dev/shm; removed afterwards."""
    token = secrets.token_hex(4)
    paths = [ROOT / f".sandbox-secret-{token}", Path.home() / f".sandbox-secret-{token}",
             Path.home() / ".opentinker" / f"sandbox-secret-{token}", ROOT / ".opentinker" / f"sandbox-secret-{token}",
             Path("/tmp") / f"sandbox-secret-{token}", Path("/dev/shm") / f"sandbox-secret-{token}"]
    made, folders = [], []
    for path in paths:
        try:
            if not path.parent.exists():
                path.parent.mkdir(parents=True)
                folders.append(path.parent)
            path.write_text(SECRET)
            made.append(path)
        except OSError:
            pass
    yield made
    for path in made:
        path.unlink(missing_ok=True)
    for folder in folders:
        shutil.rmtree(folder, ignore_errors=True)


def test_secret_files_are_not_there(sandbox, planted):
    assert planted
    code = f"""import os
paths = {[str(p) for p in planted]!r} + ['/root', '/work', {str(ROOT)!r}, '/home', '/etc/shadow', '/etc/passwd']
for p in paths:
    try:
        print(p, 'LIST', os.listdir(p)) if os.path.isdir(p) else print(p, 'READ', open(p).read())
    except OSError as err:
        print(p, 'DENIED', type(err).__name__)
for top in ['/']:
    for folder, subs, names in os.walk(top):
        subs[:] = [s for s in subs if folder + s not in ('/proc', '/usr', '/sys', '/dev')]
        for name in names:
            try:
                if {SECRET[::-1]!r}[::-1] in open(os.path.join(folder, name), errors='ignore').read(1 << 20):
                    print('FOUND', folder, name)
            except OSError:
                pass
print('done', sorted(os.listdir('/')))
"""
    result = sandbox.run(code)
    assert result.status == "Finished" and "done" in result.stdout, result
    assert SECRET not in result.stdout + result.stderr
    assert "FOUND" not in result.stdout and " READ " not in result.stdout and " LIST " not in result.stdout
    assert "'work'" not in result.stdout and "'root'" not in result.stdout and "'home'" not in result.stdout
    still_works(sandbox)


def test_no_connection_to_the_host(sandbox):
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    server.settimeout(0.2)
    port, accepted = server.getsockname()[1], []

    def accept() -> None:
        end = time.monotonic() + WALL_S + 2
        while time.monotonic() < end:
            try:
                accepted.append(server.accept())
            except OSError:
                pass

    watcher = threading.Thread(target=accept)
    watcher.start()
    hosts = ["127.0.0.1", "localhost", "::1", socket.gethostname()]
    code = f"""import socket
for host in {hosts!r}:
    try:
        socket.create_connection((host, {port}), timeout=1).close()
        print(host, 'CONNECTED')
    except OSError as err:
        print(host, 'refused', type(err).__name__)
try:
    socket.create_connection(('1.1.1.1', 80), timeout=1)
    print('internet CONNECTED')
except OSError as err:
    print('internet refused', type(err).__name__)
"""
    try:
        result = sandbox.run(code)
        watcher.join()
    finally:
        server.close()
    assert result.status == "Finished" and "CONNECTED" not in result.stdout and result.stdout.count("refused") == 5, result
    assert accepted == []
    still_works(sandbox)


def test_no_writes_outside_its_folder(sandbox):
    token = secrets.token_hex(4)
    targets = [f"/usr/otk-{token}", f"/etc/otk-{token}", f"{ROOT}/otk-{token}", f"/root/otk-{token}", f"/otk-{token}",
               f"/usr/lib/python3/otk-{token}.py", f"/proc/otk-{token}", f"/dev/otk-{token}"]
    code = f"""for path in {targets!r}:
    try:
        open(path, 'w').write('x')
        print(path, 'WROTE')
    except OSError as err:
        print(path, 'refused', type(err).__name__)
open('mine.txt', 'w').write('ok')
print(open('mine.txt').read())
"""
    result = sandbox.run(code)
    assert result.status == "Finished" and "WROTE" not in result.stdout and result.stdout.endswith("ok\n"), result
    assert not any(os.path.exists(t) for t in targets)
    still_works(sandbox)


def test_symlinks_lead_nowhere(sandbox, planted):
    target = str(planted[0])
    code = f"""import os
for name, to in [('x', '/root'), ('y', {target!r}), ('z', '/proc/1/root/root'), ('w', '/proc/self/root/..')]:
    os.symlink(to, name)
    try:
        print(name, os.listdir(name) if os.path.isdir(name) else open(name).read())
    except OSError as err:
        print(name, 'refused', type(err).__name__)
"""
    result = sandbox.run(code, fetch_files=["y", "x"])
    assert result.status == "Finished" and SECRET not in result.stdout + result.stderr, result
    assert result.files == {}, "a symlink was followed when the files came back"
    still_works(sandbox)


def test_no_child_outlives_the_call(sandbox):
    marker = f"1000.{secrets.randbelow(10**6):06d}"
    code = f"""import os, subprocess
subprocess.Popen(['setsid', 'sleep', '{marker}'])
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        os.execv('/usr/bin/sleep', ['sleep', '{marker}'])
    os._exit(0)
print('parent out')
"""
    result = sandbox.run(code)
    assert result.status == "Finished" and result.stdout == "parent out\n", result
    assert gone(marker, within_s=1.0), f"processes left on the host: {host_processes_with(marker)}"
    still_works(sandbox)


def test_host_processes_and_environment_are_invisible(sandbox, monkeypatch):
    monkeypatch.setenv("OTK_SANDBOX_TEST_SECRET", SECRET)  # our environment: bwrap inherits it and must clear it
    witness = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", SECRET], env={**os.environ})
    try:
        code = f"""import os
print('ENV', dict(os.environ))
print('PIDS', sorted(int(p) for p in os.listdir('/proc') if p.isdigit()))
for pid in ['1', '{os.getpid()}', '{witness.pid}', 'self']:
    for what in ('environ', 'cmdline'):
        try:
            print(pid, what, open(f'/proc/{{pid}}/{{what}}', 'rb').read())
        except OSError as err:
            print(pid, what, 'refused', type(err).__name__)
print('UID', os.getuid(), os.getgid(), open('/proc/self/status').read().split('CapEff:')[1].split()[0])
"""
        result = sandbox.run(code)
    finally:
        witness.kill()
        witness.wait()
    assert result.status == "Finished" and SECRET not in result.stdout + result.stderr, result
    pids = eval(result.stdout.split("PIDS ")[1].splitlines()[0])  # noqa: S307 - our own print of a list of ints
    assert max(pids) < 10 and os.getpid() not in pids and witness.pid not in pids
    assert "UID 65534 65534 0000000000000000" in result.stdout
    still_works(sandbox)


def test_missing_bwrap_is_one_clear_line():
    with pytest.raises(RuntimeError, match=r"^the python tool needs bubblewrap \(Debian package: bubblewrap\): .*not found"):
        Sandbox(bwrap="/nonexistent/bwrap")
