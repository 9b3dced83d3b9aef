"""The sandbox model-written code runs in: bubblewrap (Debian package `bubblewrap`), never our process.

One `Sandbox.run(code)` starts `bwrap` around the system's `/usr/bin/python3` (not the project's
virtualenv) with:

- every namespace of its own (`--unshare-all`): a network namespace with only a loopback in it
  (127.0.0.1 reaches nothing of the host), its own pid namespace (the host's processes, their
  `/proc/<pid>/environ` included, are not there), ipc, uts; a user namespace in which it is uid/gid
  65534. When we are root, bwrap itself is started as host uid/gid 65534 (Popen `user=`), so the
  sandbox is nobody on the host too: root's processes are exempt from RLIMIT_NPROC, nobody's are not;
- only `/usr` (with the `/bin`, `/lib`, `/lib64` links to it), `/etc/ld.so.cache` and
  `/etc/localtime`, read-only. `$HOME`, `/root`, `/work`, the project's checkout, the stack's state
  folder, the host's `/tmp` and `/dev/shm` do not exist inside;
- a fresh tmpfs at `/tmp` (capped at `disk_mb`) as its working folder, holding `main.py` and the
  caller's files (copied in through memfds with `--file`), a private `--proc` and a minimal `--dev`;
- `--clearenv` (PATH, HOME=/tmp, LANG), `--die-with-parent`, `--new-session` (no TIOCSTI onto our
  terminal), and no capabilities;
- `--disable-userns`: the program cannot make user namespaces of its own (with one it could mount
  a tmpfs of any size);
- limits set inside by `prlimit` just before Python starts: RLIMIT_CPU, RLIMIT_AS, RLIMIT_NPROC
  (counted per sandbox: each has its own user namespace), RLIMIT_FSIZE, RLIMIT_NOFILE; the wall time is enforced
  from outside: the whole process group is SIGKILLed, bwrap's pid 1 dies with its parent and the
  kernel then kills everything left in the pid namespace (a double-forked `setsid` child included);
- each call in cgroups of its own (sandbox_cgroups.py): its memory (page cache, tmpfs, memfd,
  pipes, sockets, kernel memory), processes and CPU bounded from the host's side, all sandboxes
  together at most half the host's memory. Where cgroups cannot be had the sandbox says so once
  and runs its stricter fallback (`fallback_limits`): fewer processes, descriptors and smaller
  files, so the host memory a call can hold has a stated bound, and one call at a time per owner;
- stdout and stderr read to the end but kept only up to `output_bytes` each (flagged truncated);
- slots shared fairly: an owner (a tenant's job, named `tenant/job` by OPENTINKER_SANDBOX_OWNER,
  which the job's actors carry; else this process) runs at most `max_running` calls at once, and
  the machine at most `MACHINE_FACTOR` times the CPUs (with cgroups, which share the CPU equally
  between tenants, then jobs) or the CPUs (fallback). A run holds an exclusive `flock` on one slot
  file of its owner and one of the machine, in a 0700 folder of our own,
  `/dev/shm/opentinker-sandbox-<uid>` (or the temp folder where there is no /dev/shm), so another
  tenant's call finds a slot while one tenant's long calls run.

Python runs as `python3 -E -s main.py` (what `-I` does, less `-P`): the environment is already
cleared, and the script's folder stays on sys.path, so a file given in `files` imports as it does in
SandboxFusion.
"""

from __future__ import annotations

import json
import logging
import math
import os
import posixpath
import shutil
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Any

from opentinker.tools.declared import Tool, ToolError
from opentinker.tools.sandbox_cgroups import CallGroup, CallGroups, launcher
from opentinker.tools.sandbox_slots import Slots
from opentinker.tools.sandbox_streams import decode_files, drain, exited_within, feed, memfd

log = logging.getLogger(__name__)

BWRAP = "/usr/bin/bwrap"
_SAID: set[str] = set()  # the fallback's reasons already logged in this process
PYTHON = "/usr/bin/python3"
PRLIMIT = "/usr/bin/prlimit"
SETPRIV = "/usr/bin/setpriv"
NOBODY = 65534
MISSING = "the python tool needs bubblewrap (Debian package: bubblewrap)"
LANGUAGES = ("python", "python3")
OWNER_ENV = "OPENTINKER_SANDBOX_OWNER"  # whose calls these are: "tenant/job" (orchestration/actors.py sets it)
MACHINE_FACTOR = 4  # with cgroups, calls at once on the machine per CPU (the CPU is shared by weight, memory capped)
TCP_SHARE = 8  # a call's TCP buffers may take this fraction of its memory (cgroup v1 counts them apart)
# With fetch_files: run the program as a child, then send the files back on fd 3 (JSON, base64).
_FETCH = """import base64, json, os, subprocess, sys
rc = subprocess.call([sys.executable, '-E', '-s', 'main.py'])
out, cap = {}, int(sys.argv[1])
for name in json.loads(sys.argv[2]):
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW)
        with os.fdopen(fd, 'rb') as f:
            out[name] = base64.b64encode(f.read(cap + 1)).decode()
    except OSError:
        pass
with os.fdopen(int(sys.argv[3]), 'w') as f:
    json.dump(out, f)
sys.exit(rc if rc >= 0 else 128 - rc)
"""


@dataclass
class SandboxLimits:
    """What one run may use. `max_running` is per owner (see the module's docstring)."""

    wall_s: float = 5.0
    cpu_s: int = 5
    memory_mb: int = 512  # RLIMIT_AS of each process, and (cgroups) of the whole call
    processes: int = 32  # RLIMIT_NPROC inside the sandbox's own user namespace, and (cgroups) pids.max
    file_size_mb: int = 16  # RLIMIT_FSIZE: the largest file it may write
    open_files: int = 256  # RLIMIT_NOFILE
    disk_mb: int = 64  # each tmpfs, /tmp and /dev/shm
    output_bytes: int = 64 * 1024  # kept of stdout, and of stderr
    max_running: int = field(default_factory=lambda: os.cpu_count() or 1)  # calls of one owner at once


def fallback_limits(limits: SandboxLimits) -> SandboxLimits:
    """Where no cgroup bounds a call: fewer processes, descriptors and smaller files (memfds and
    pipes are bounded only through them), at most `limits`."""
    return replace(limits, processes=min(limits.processes, 4), open_files=min(limits.open_files, 32),
                   file_size_mb=min(limits.file_size_mb, 8))


def fallback_bound_mb(limits: SandboxLimits) -> int:
    """What a call can hold of the host at most without cgroups: each process its address space and
    a full file per descriptor, plus both tmpfs."""
    return limits.processes * (limits.memory_mb + limits.open_files * limits.file_size_mb) + 2 * limits.disk_mb


@dataclass
class RunResult:
    """One run. status: Finished (the program exited, see return_code), TimeLimitExceeded (wall or
    CPU time; return_code None when killed at the wall limit) or Error (the sandbox failed: message)."""

    status: str
    return_code: int | None
    stdout: str
    stderr: str
    wall_s: float
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    message: str = ""
    files: dict[str, bytes] = field(default_factory=dict)
    memory_peak_mb: float | None = None  # the call's cgroup's peak (None: no cgroup)


def _checked_path(name: str) -> str:
    """A file's path inside the working folder: relative (or under /tmp/), no `..`."""
    rel = name[len("/tmp/"):] if name.startswith("/tmp/") else name
    norm = posixpath.normpath(rel) if rel else ""
    if not norm or norm.startswith(("/", "..")) or norm in (".", "main.py") or "\0" in norm:
        raise ValueError(f"file path {name!r}: must be relative to the working folder, without '..' (and not main.py)")
    return norm


class Sandbox:
    """Runs Python in bubblewrap under `limits`. `Sandbox()` checks bwrap works here (RuntimeError
    naming the Debian package when it does not); `run` is thread-safe."""

    _checked: set[str] = set()
    _groups: tuple[CallGroups | None, str] | None = None  # this process's, made once

    def __init__(self, limits: SandboxLimits | None = None, bwrap: str | None = None, owner: str | None = None,
                 cgroups: bool = True):
        """`owner`: whose calls ("tenant/job"; default OPENTINKER_SANDBOX_OWNER, else this process);
        `cgroups=False` runs the fallback even where cgroups could be had."""
        self.limits = asked = limits or SandboxLimits()
        self.bwrap = bwrap or shutil.which("bwrap") or BWRAP
        self._as_nobody = os.geteuid() == 0
        self.check()
        self.groups, why = self.call_groups() if cgroups else (None, "cgroups turned off for this sandbox")
        cpus = os.cpu_count() or 1
        if self.groups is not None:
            self.limits, per_owner, machine = asked, asked.max_running, MACHINE_FACTOR * cpus
        else:  # the machine's CPUs as its cap; an owner leaves one slot to others
            self.limits = fallback_limits(asked)
            machine = max(asked.max_running, 1)
            per_owner = max(1, machine - 1)
            self.fallback = (f"the sandbox runs without cgroups here ({why}): each call is held to {self.limits.processes} processes, "
                             f"{self.limits.open_files} open files and {self.limits.file_size_mb} MB files, at most "
                             f"{fallback_bound_mb(self.limits)} MB of the host, {per_owner} of an owner's calls at once")
            if why not in _SAID:
                _SAID.add(why)
                log.warning(self.fallback)
        self.owner = owner or os.environ.get(OWNER_ENV) or f"process-{os.getpid()}"
        self._slots = Slots(self.owner, per_owner, machine)

    fallback = ""  # the one line said where there are no cgroups

    @classmethod
    def call_groups(cls) -> tuple[CallGroups | None, str]:
        if cls._groups is None:
            cls._groups = CallGroups.here()
        return cls._groups

    def check(self) -> None:
        """One empty run: bwrap present, namespaces allowed, python3 there."""
        if self.bwrap in Sandbox._checked:
            return
        if not os.access(self.bwrap, os.X_OK):
            raise RuntimeError(f"{MISSING}: {self.bwrap} not found; apt-get install bubblewrap")
        for path in (PYTHON, PRLIMIT, SETPRIV):
            if not os.access(path, os.X_OK):
                raise RuntimeError(f"{MISSING}: {path} not found (Debian packages python3 and util-linux)")
        try:
            done = subprocess.run([*self._bwrap_args([]), PYTHON, "-E", "-s", "-c", "print(1)"], capture_output=True,
                                  timeout=30, **self._popen_user())
        except (OSError, subprocess.TimeoutExpired) as err:
            raise RuntimeError(f"{MISSING}: {self.bwrap} could not run: {err}") from None
        if done.returncode != 0 or done.stdout.strip() != b"1":
            why = (done.stderr.decode(errors="replace").strip().splitlines() or [f"exit status {done.returncode}"])[-1]
            raise RuntimeError(f"{MISSING}: it cannot create its namespaces here: {why}")
        Sandbox._checked.add(self.bwrap)

    def _popen_user(self) -> dict[str, Any]:
        """bwrap's own user and environment: its pid 1 inside keeps the environment it was started
        with (--clearenv is for the program only), and the program may read /proc/1/environ."""
        return {"env": {"PATH": "/usr/bin:/bin"}, **({"user": NOBODY, "group": NOBODY, "extra_groups": []} if self._as_nobody else {})}

    def _bwrap_args(self, extra: list[str]) -> list[str]:
        args = [self.bwrap, "--unshare-all", "--die-with-parent", "--new-session", "--unshare-user", "--disable-userns",
                "--uid", str(NOBODY), "--gid", str(NOBODY), "--hostname", "sandbox",
                "--ro-bind", "/usr", "/usr"]
        for link in ("bin", "lib", "lib64", "sbin"):
            if os.path.islink(f"/{link}"):
                args += ["--symlink", os.readlink(f"/{link}"), f"/{link}"]
            elif os.path.isdir(f"/{link}"):
                args += ["--ro-bind", f"/{link}", f"/{link}"]
        for name in ("/etc/ld.so.cache", "/etc/localtime"):
            args += ["--ro-bind-try", name, name]
        size = str(self.limits.disk_mb << 20)
        args += ["--proc", "/proc", "--dev", "/dev", "--size", size, "--tmpfs", "/dev/shm", "--size", size, "--tmpfs", "/tmp",
                 *extra, "--remount-ro", "/dev", "--remount-ro", "/", "--chdir", "/tmp", "--clearenv", "--setenv", "PATH", "/usr/bin:/bin", "--setenv", "HOME", "/tmp",
                 "--setenv", "LANG", "C.UTF-8"]
        return args

    def _limits(self, memory_mb: int | None, cpu: int) -> list[str]:
        lim = self.limits
        return [PRLIMIT, f"--cpu={cpu}:{cpu + 1}", f"--as={(memory_mb or lim.memory_mb) << 20}",
                f"--nproc={lim.processes}", f"--fsize={lim.file_size_mb << 20}", f"--nofile={lim.open_files}", "--core=0", "--"]

    def run(self, code: str, stdin: str = "", files: dict[str, bytes] | None = None, language: str = "python", *,
            wall_s: float | None = None, memory_mb: int | None = None, fetch_files: list[str] | None = None,
            queue_timeout_s: float = 300.0) -> RunResult:
        """Run `code` (with `stdin`, and `files` in its working folder); `wall_s`/`memory_mb` lower
        or raise this run's limits. `fetch_files` (relative paths) come back in `files`, each up to
        file_size_mb. ValueError for a language other than Python or a bad file path."""
        if language not in LANGUAGES:
            raise ValueError(f"language {language!r} is not supported: this sandbox runs python only")
        wall = float(wall_s if wall_s is not None else self.limits.wall_s)
        wanted = [_checked_path(name) for name in fetch_files or []]
        fds, extra, made = [], [], set()
        try:
            for name, data in [("main.py", code.encode("utf-8", "surrogatepass")), *sorted((_checked_path(k), v) for k, v in (files or {}).items())]:
                parts = name.split("/")
                for i in range(1, len(parts)):
                    folder = "/tmp/" + "/".join(parts[:i])
                    if folder not in made:
                        made.add(folder)
                        extra += ["--dir", folder]
                fds.append(memfd(data))
                extra += ["--file", str(fds[-1]), f"/tmp/{name}"]
            cpu_s = max(self.limits.cpu_s, math.ceil(wall)) if wall_s is not None else self.limits.cpu_s
            command = [*self._bwrap_args(extra), *self._limits(memory_mb, cpu_s)]
            if wanted:
                command += [PYTHON, "-E", "-s", "-c", _FETCH, str(self.limits.file_size_mb << 20), json.dumps(wanted)]
            else:
                command += [PYTHON, "-E", "-s", "main.py"]
            slot = self._slots.acquire(queue_timeout_s)
            try:
                group = None
                if self.groups is not None:
                    memory = (memory_mb or self.limits.memory_mb) << 20
                    tcp = max(4 << 20, memory // TCP_SHARE)
                    try:  # +3: bwrap, its pid 1 inside, then the program
                        group = self.groups.make(self.owner, memory - tcp, tcp, self.limits.processes + 3)
                    except OSError as err:
                        return RunResult("Error", None, "", "", 0.0, message=f"could not make the call's cgroups: {err}")
                try:
                    return self._run(command, fds, stdin.encode("utf-8", "surrogatepass"), wall, cpu_s, bool(wanted), group)
                finally:
                    if group is not None:
                        group.remove()
            finally:
                self._slots.release(slot)
        finally:
            for fd in fds:
                os.close(fd)

    def _run(self, command: list[str], fds: list[int], stdin: bytes, wall: float, cpu_s: int, fetch: bool,
             group: CallGroup | None) -> RunResult:
        cap = self.limits.output_bytes
        if group is not None:  # root joins the call's cgroups, then becomes nobody: all of the call is born inside them
            command, user = [*launcher(group, NOBODY, NOBODY), *command], {"env": self._popen_user()["env"]}
        else:
            user = self._popen_user()
        back_r = back_w = None
        if fetch:
            back_r, back_w = os.pipe()
            command = [*command, str(back_w)]
        start = time.monotonic()
        try:
            proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    pass_fds=[*fds, *([back_w] if fetch else [])], start_new_session=True, **user)
        except OSError as err:
            for fd in (back_r, back_w):
                if fd is not None:
                    os.close(fd)
            return RunResult("Error", None, "", "", 0.0, message=f"could not start bwrap: {err}")
        if back_w is not None:
            os.close(back_w)
        out, err, flags_out, flags_err, back, back_flags = [], [], [], [], [], []
        threads = [threading.Thread(target=drain, args=(proc.stdout, cap, out, flags_out), daemon=True),
                   threading.Thread(target=drain, args=(proc.stderr, cap, err, flags_err), daemon=True),
                   threading.Thread(target=feed, args=(proc.stdin, stdin), daemon=True)]
        if back_r is not None:
            reader = os.fdopen(back_r, "rb")
            threads.append(threading.Thread(target=drain, args=(reader, 4 * (self.limits.file_size_mb << 20), back, back_flags), daemon=True))
        for t in threads:
            t.start()
        try:
            timed_out = not exited_within(proc, wall)
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # the group; bwrap's pid 1 dies with it, and its namespace with it
            except (ProcessLookupError, PermissionError):
                pass
            proc.wait()
        for t in threads:
            t.join(timeout=5.0)
        elapsed = time.monotonic() - start
        for stream in (proc.stdout, proc.stderr):
            stream.close()
        stdout, stderr = b"".join(out).decode(errors="replace"), b"".join(err).decode(errors="replace")
        rc = proc.returncode
        result = RunResult("Finished", rc, stdout, stderr, round(elapsed, 4), bool(flags_out and flags_out[0]),
                           bool(flags_err and flags_err[0]))
        if timed_out:
            result.status, result.return_code, result.message = "TimeLimitExceeded", None, f"timed out after {wall:g} s"
        elif rc in (128 + signal.SIGXCPU, -signal.SIGXCPU):
            result.status, result.message = "TimeLimitExceeded", f"timed out: over its CPU time limit of {cpu_s} s"
        elif rc == 1 and stderr.startswith("bwrap:"):
            result.status, result.message = "Error", stderr.strip().splitlines()[0]
        elif group is not None and group.oom_killed():
            limit_mb = sum(int((group.folders["memory"] / name).read_text()) for name in
                           ("memory.limit_in_bytes", "memory.kmem.tcp.limit_in_bytes")) >> 20
            result.message = f"killed: over its memory limit of {limit_mb} MB"
        if group is not None:
            result.memory_peak_mb = round(group.peak_bytes() / (1 << 20), 1)
        if back_r is not None:
            reader.close()
            result.files = decode_files(b"".join(back), self.limits.file_size_mb << 20)
        return result


def describe(result: RunResult, limit: int) -> str:
    """A run as text for the model: stdout, then stderr, exit status and limits where relevant."""
    parts = [result.stdout]
    if result.stderr:
        parts.append(f"[stderr]\n{result.stderr}")
    if result.stdout_truncated or result.stderr_truncated:
        parts.append(f"[output truncated at {limit} bytes per stream]")
    if result.status == "TimeLimitExceeded":
        parts.append(f"[{result.message}]")
    elif result.status == "Error":
        parts.append(f"[sandbox error: {result.message}]")
    elif result.message:
        parts.append(f"[{result.message}]")
    elif result.return_code:
        parts.append(f"[exit status {result.return_code}]")
    text = "\n".join(p.rstrip("\n") for p in parts if p).strip("\n")
    return text or "[no output]"


def python_tool(sandbox: Sandbox) -> Tool:
    """The `python` tool: runs the model's code in `sandbox`, answers its output as text."""
    limits = sandbox.limits

    def run(arguments: dict[str, Any]) -> str:
        code = arguments.get("code")
        if not isinstance(code, str) or not code.strip():
            raise ToolError("`code` must be a non-empty string of Python")
        return describe(sandbox.run(code), limits.output_bytes)

    description = (f"Run a Python 3 program in a sandbox (no network, no files kept between calls, {limits.wall_s:g} s, "
                   f"{limits.memory_mb} MB) and return what it prints. Print the values you need.")
    parameters = {"type": "object", "properties": {"code": {"type": "string", "description": "a complete Python 3 program; its stdout is the answer"}},
                  "required": ["code"]}
    return Tool(name="python", description=description, run=run, parameters=parameters, timeout_s=limits.wall_s + 60.0)
