"""The sandbox's slots, shared fairly across processes: a run holds an exclusive `flock` on one slot
file of its owner's and one of the machine's, in a 0700 folder of ours (sandbox.py says how many)."""

from __future__ import annotations

import errno
import fcntl
import os
import stat
import tempfile
import threading
import time
from pathlib import Path

from opentinker.tools.sandbox_cgroups import owner_parts


class Slots:
    """Slot files, one `flock` each: a run holds one of its owner's `per_owner` and one of the
    machine's `machine` for its whole length (and, within this process, one of `per_owner` places
    of a semaphore first, so that its own callers wait in turn)."""

    def __init__(self, owner: str, per_owner: int, machine: int):
        self.here = threading.Semaphore(max(1, per_owner))  # this process's callers queue here, in order, not in the spin below
        base = Path("/dev/shm") if os.path.isdir("/dev/shm") else Path(tempfile.gettempdir())
        self.folder = base / f"opentinker-sandbox-{os.getuid()}"
        private_folder(self.folder)
        self.owner_folder = self.folder / "owner" / "--".join(owner_parts(owner))
        private_folder(self.folder / "owner")
        private_folder(self.owner_folder)
        self.per_owner, self.n = max(1, per_owner), max(1, machine)

    def acquire(self, timeout_s: float) -> tuple[int, int]:
        deadline = time.monotonic() + timeout_s
        if not self.here.acquire(timeout=timeout_s):
            raise TimeoutError(f"no sandbox slot free in {timeout_s:.0f} s ({self.per_owner} of this owner running)")
        mine = None
        try:
            mine = lock(self.owner_folder, self.per_owner, deadline, f"no sandbox slot free in {timeout_s:.0f} s "
                                                                       f"({self.per_owner} of this owner running)")
            return mine, lock(self.folder, self.n, deadline, f"no sandbox slot free in {timeout_s:.0f} s ({self.n} running on this machine)")
        except BaseException:
            if mine is not None:
                os.close(mine)
            self.here.release()
            raise

    def release(self, fds: tuple[int, int]) -> None:
        for fd in fds:
            os.close(fd)
        self.here.release()


def private_folder(folder: Path) -> None:
    try:
        os.mkdir(folder, 0o700)
    except FileExistsError:
        pass
    info = os.lstat(folder)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
        raise RuntimeError(f"{folder} is not a 0700 folder of uid {os.getuid()}: remove it")


def lock(folder: Path, n: int, deadline: float, why: str) -> int:
    """An exclusive flock on one of `folder`'s n slot files, waiting until `deadline`."""
    wait = 0.001
    while True:
        for i in range(n):
            fd = os.open(folder / f"slot-{i}", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return fd
            except OSError as err:
                os.close(fd)
                if err.errno not in (errno.EAGAIN, errno.EACCES):
                    raise
        if time.monotonic() > deadline:
            raise TimeoutError(why)
        time.sleep(wait)
        wait = min(wait * 2, 0.02)
