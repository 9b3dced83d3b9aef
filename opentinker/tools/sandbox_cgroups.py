"""Each sandboxed call in cgroups of its own, so its limits bound what it takes from the host.

RLIMIT_AS counts one process's address space only: memfd pages, a tmpfs's pages, pipe and socket
buffers and kernel memory are not in it, and a call may run many processes. A cgroup counts them
all. Per call, under the cgroup v1 controllers this process already sits in:

    memory/<ours>/opentinker-sandbox/<tenant>/<job>/call-<id>   limit = the call's memory (page cache,
        shmem: tmpfs and memfd, kernel memory: pipes, unix sockets), less its TCP budget, which v1
        counts apart (memory.kmem.tcp): the two together are the call's memory; no swap.
    pids/<ours>/opentinker-sandbox/…/call-<id>     pids.max = the call's processes (and threads)
    cpu/<ours>/opentinker-sandbox/…/call-<id>      at most one CPU (CFS quota); equal shares at each
        level above, so tenants share the CPU equally, then each tenant's jobs, then their calls; the
        tree as a whole weighs as much as one busy process per CPU beside the host's own.

`opentinker-sandbox` itself is capped at half the host's memory: all sandboxes together can never
push the kernel's OOM killer onto vLLM, Ray or the gateway, which sit outside it (an OOM inside a
call's cgroup kills inside that call).

The process that becomes bwrap joins the call's cgroups before it drops to nobody and execs
(`launcher`), so every process of the call is born inside them. This needs root and the v1
`memory`, `pids` and `cpu` controllers (this machine kind has them; a cgroup2-only host has its
controllers in one tree, not supported here yet). Where they cannot be had, `CallGroups.here()`
says why and the sandbox runs its stricter fallback (sandbox.py).
"""

from __future__ import annotations

import errno
import os
import re
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path("/sys/fs/cgroup")
CONTROLLERS = ("memory", "pids", "cpu")
TREE = "opentinker-sandbox"
HOST_SHARE = 0.5  # of the host's memory: what all sandboxes together may hold
CPU_PERIOD_US = 100_000
_NAME = re.compile(r"[^A-Za-z0-9_.-]")


def _own_paths() -> dict[str, Path]:
    """Each v1 controller's folder of this process (`/proc/self/cgroup`: `4:memory:/some/path`)."""
    found: dict[str, Path] = {}
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, names, path = line.split(":", 2)
        for name in names.split(","):
            if name in CONTROLLERS:
                found[name] = ROOT / name / path.lstrip("/")
    return found


def owner_parts(owner: str) -> list[str]:
    """`tenant/job` as at most two safe folder names."""
    parts = [(_NAME.sub("_", p)[:64] or "_").lstrip(".") or "_" for p in owner.split("/") if p][:2]
    return parts or ["_"]


def _write(path: Path, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


def _host_memory_bytes() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) * 1024
    raise OSError("no MemTotal in /proc/meminfo")


@dataclass
class CallGroup:
    """One call's cgroups: `procs` are the files its launcher writes itself into."""

    folders: dict[str, Path]

    @property
    def procs(self) -> list[str]:
        return [str(folder / "cgroup.procs") for folder in self.folders.values()]

    def oom_killed(self) -> bool:
        """Whether the kernel killed a process of the call for its memory limit."""
        try:
            text = (self.folders["memory"] / "memory.oom_control").read_text()
        except OSError:
            return False
        return any(line.startswith("oom_kill ") and int(line.split()[1]) > 0 for line in text.splitlines())

    def peak_bytes(self) -> int:
        """The most memory the call held at once (its TCP buffers apart)."""
        try:
            return int((self.folders["memory"] / "memory.max_usage_in_bytes").read_text())
        except (OSError, ValueError):
            return 0

    def remove(self, within_s: float = 5.0) -> None:
        """Kill whatever is left in the call's cgroups and remove them (a leftover is retried, then left)."""
        deadline = time.monotonic() + within_s
        for folder in self.folders.values():
            while True:
                try:
                    for pid in (folder / "cgroup.procs").read_text().split():
                        try:
                            os.kill(int(pid), signal.SIGKILL)
                        except (ProcessLookupError, PermissionError):
                            pass
                    folder.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError as err:
                    if err.errno != errno.EBUSY or time.monotonic() > deadline:
                        break
                    time.sleep(0.01)
            for parent in (folder.parent, folder.parent.parent):  # the job's, then the tenant's, once empty
                if parent.name == TREE:
                    break
                try:
                    parent.rmdir()
                except OSError:
                    break


class CallGroups:
    """Makes the calls' cgroups on this machine (see the module's docstring)."""

    def __init__(self, bases: dict[str, Path]):
        self.bases = bases  # controller -> our opentinker-sandbox folder
        self._count = 0
        self._lock = threading.Lock()

    @classmethod
    def here(cls) -> tuple[CallGroups | None, str]:
        """The machine's call groups, or None and why there are none (one line)."""
        if os.geteuid() != 0:
            return None, "not running as root, so no cgroup of its own per call"
        try:
            own = _own_paths()
        except OSError as err:
            return None, f"cannot read /proc/self/cgroup: {err}"
        missing = [name for name in CONTROLLERS if name not in own or not own[name].is_dir()]
        if missing:
            return None, f"no cgroup v1 {', '.join(missing)} controller mounted under {ROOT}"
        bases = {name: own[name] / TREE for name in CONTROLLERS}
        try:
            for name, base in bases.items():
                base.mkdir(exist_ok=True)
            # the tree weighs on the CPU as much as one busy process per CPU does (the host's own stay served)
            _write(bases["cpu"] / "cpu.shares", str(1024 * (os.cpu_count() or 1)))
            limit, memory = int(_host_memory_bytes() * HOST_SHARE), bases["memory"]
            if int((memory / "memory.limit_in_bytes").read_text()) > limit:
                _write(memory / "memory.limit_in_bytes", str(limit))
        except (OSError, ValueError) as err:
            return None, f"cannot make cgroups under {ROOT}: {err}"
        for base in bases.values():
            _sweep(base)
        return cls(bases), ""

    def make(self, owner: str, memory_bytes: int, tcp_bytes: int, processes: int) -> CallGroup:
        """The cgroups of one call of `owner` ("tenant/job"), limits set, nothing in them yet."""
        with self._lock:
            self._count += 1
            name = f"call-{os.getpid()}-{self._count}"
        parts = owner_parts(owner)
        folders = {controller: base.joinpath(*parts, name) for controller, base in self.bases.items()}
        group = CallGroup(folders)
        try:
            for folder in folders.values():
                _make_under_removals(folder)
            memory = folders["memory"]
            _write(memory / "memory.limit_in_bytes", str(memory_bytes))
            if (memory / "memory.memsw.limit_in_bytes").exists():
                _write(memory / "memory.memsw.limit_in_bytes", str(memory_bytes))  # no swap either
            _write(memory / "memory.kmem.tcp.limit_in_bytes", str(tcp_bytes))
            _write(folders["pids"] / "pids.max", str(processes))
            _write(folders["cpu"] / "cpu.cfs_period_us", str(CPU_PERIOD_US))
            _write(folders["cpu"] / "cpu.cfs_quota_us", str(CPU_PERIOD_US))  # one CPU
        except OSError:
            group.remove()
            raise
        return group


def _make_under_removals(folder: Path, within_s: float = 5.0) -> None:
    """mkdir `folder` and its parents while other calls' ends remove the owner's folders whenever
    they are empty: gone under our mkdir, or between its `File exists` and its check, we try again
    (our own folder, once made, keeps its parents from being removed)."""
    deadline = time.monotonic() + within_s
    while True:
        try:
            folder.parent.mkdir(parents=True, exist_ok=True)
            folder.mkdir()
            return
        except (FileNotFoundError, FileExistsError):
            if folder.exists() or time.monotonic() > deadline:
                raise


def _sweep(base: Path) -> None:
    """Remove the empty call folders of processes that died mid-call (a killed job leaves them)."""
    for folder in sorted(base.rglob("call-*"), reverse=True):
        try:
            pid = int(folder.name.split("-")[1])
            os.kill(pid, 0)
            continue  # its process is alive: its calls may be running
        except ProcessLookupError:
            pass
        except (ValueError, IndexError, PermissionError):
            continue
        CallGroup({"": folder}).remove(within_s=0.0)


def launcher(group: CallGroup, uid: int, gid: int) -> list[str]:
    """The command prefix that joins `group` as root, then becomes uid/gid (no groups) and execs the rest."""
    joins = " && ".join(f'echo 0 > "${i}"' for i in range(1, len(group.procs) + 1))
    script = f'{joins} && shift {len(group.procs)} && exec "$@"'
    return ["/bin/sh", "-c", script, "sh", *group.procs,
            "/usr/bin/setpriv", f"--reuid={uid}", f"--regid={gid}", "--clear-groups", "--"]
