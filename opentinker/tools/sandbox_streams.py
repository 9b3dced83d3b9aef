"""A sandboxed run's streams: its input files as memfds, stdout and stderr drained to a cap, stdin
fed, its exit awaited through a pidfd, and the files it sends back decoded (never trusted)."""

from __future__ import annotations

import base64
import binascii
import json
import os
import select
import subprocess


def memfd(data: bytes) -> int:
    fd = os.memfd_create("sandbox-input", 0)  # no MFD_CLOEXEC: bwrap reads it
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def drain(stream, cap: int, into: list, flags: list) -> None:
    """Read `stream` to its end, keeping its first `cap` bytes."""
    kept = 0
    try:
        while chunk := stream.read1(65536) if hasattr(stream, "read1") else stream.read(65536):
            if kept < cap:
                into.append(chunk[: cap - kept])
            kept += len(chunk)
    except (OSError, ValueError):
        pass
    finally:
        flags.append(kept > cap)


def feed(stream, data: bytes) -> None:
    try:
        if data:
            stream.write(data)
    except (BrokenPipeError, OSError, ValueError):
        pass
    finally:
        try:
            stream.close()
        except OSError:
            pass


def exited_within(proc: subprocess.Popen, seconds: float) -> bool:
    """Wait for `proc` up to `seconds`, woken by its pidfd the moment it exits (Popen.wait(timeout)
    polls in sleeps of up to 50 ms: that was most of a short run's cost)."""
    try:
        fd = os.pidfd_open(proc.pid)
    except (AttributeError, OSError):
        try:
            proc.wait(timeout=seconds)
            return True
        except subprocess.TimeoutExpired:
            return False
    try:
        return bool(select.select([fd], [], [], max(0.0, seconds))[0])
    finally:
        os.close(fd)


def decode_files(raw: bytes, cap: int) -> dict[str, bytes]:
    """The driver's JSON (written by the sandboxed side: checked, never trusted)."""
    try:
        data = json.loads(raw or b"{}")
    except ValueError:
        return {}
    out = {}
    if isinstance(data, dict):
        for name, value in data.items():
            if isinstance(name, str) and isinstance(value, str):
                try:
                    content = base64.b64decode(value, validate=True)
                except (binascii.Error, ValueError):
                    continue
                if len(content) <= cap:
                    out[name] = content
    return out
