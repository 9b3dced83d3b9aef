"""Processes the stack owns: is a pid still ours and alive, is a port free, the end of a log, and
stopping a service with its children (its own process group)."""

from __future__ import annotations

import errno
import os
import socket
import time
from pathlib import Path

import psutil


class PortError(RuntimeError):
    """A host that does not resolve or cannot be bound."""


def alive(pid: int, keywords: tuple[str, ...]) -> bool:
    """Is `pid` a live (not zombie) process whose command line has all `keywords`?"""
    try:
        proc = psutil.Process(pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            try:
                os.waitpid(pid, os.WNOHANG)  # reap it if it is our child
            except ChildProcessError:
                pass
            return False
        cmdline = " ".join(proc.cmdline())
    except psutil.Error:
        return False
    return all(word in cmdline for word in keywords)


def port_free(host: str, port: int) -> bool:
    """Can a server bind host:port? (SO_REUSEADDR, like uvicorn: TIME_WAIT leftovers are fine.)"""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as exc:
        raise PortError(f"cannot resolve host {host!r}: {exc}; set OPENTINKER_BIND_HOST or OPENTINKER_HOST") from None
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(address)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return False
            raise PortError(f"cannot bind {host}:{port}: {exc.strerror}; set OPENTINKER_BIND_HOST or OPENTINKER_HOST") from None
    return True


def tail(path: Path, lines: int = 8) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    kept = [line for line in text if line.strip()][-lines:]
    return "\n".join(f"    {line}" for line in kept) or "    (log is empty)"



def reap(pid: int, timeout: float = 2.0) -> None:
    """Collect our exited child `pid` (no-op for a process that is not our child)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            done, _ = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            return
        if done or time.monotonic() > deadline:
            return
        time.sleep(0.05)


def signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def group_members(pgid: int, keyword: str = "") -> list[psutil.Process]:
    """Live (non-zombie) processes of group `pgid` whose command line has `keyword`.
    Reaps the group leader first if it is our own exited child."""
    try:
        os.waitpid(pgid, os.WNOHANG)
    except ChildProcessError:
        pass
    members = []
    for proc in psutil.process_iter(["status", "cmdline"]):
        try:
            if (os.getpgid(proc.pid) == pgid and proc.info["status"] != psutil.STATUS_ZOMBIE
                    and keyword in " ".join(proc.info["cmdline"] or ())):
                members.append(proc)
        except (ProcessLookupError, psutil.Error):
            continue
    return members
