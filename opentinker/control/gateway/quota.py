"""A tenant's limits hold under a burst: one admission at a time per tenant.

Counting a tenant's waiting jobs and creating the next flow run are two calls to Prefect; without
a lock, concurrent submissions all count the same number and all pass (500 at once admitted 59
against a limit of 20). Under `tenant_lock` each submission counts what the previous one created,
so a burst admits exactly the limit.

The lock is the gateway's: a thread lock per tenant (the gateway serves requests on threads) and
an exclusive `flock` on `<state>/locks/tenant-<name>`, which also serializes several gateway
processes sharing a state folder on one machine. That is enough because the gateway is the one
door tenants submit through, and one process (the stack's uvicorn runs one worker; infra/k8s runs
one replica); submissions that bypass it (the operator's CLI) are not a tenant's.
"""

from __future__ import annotations

import fcntl
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from opentinker.core.settings import Settings

_LOCKS: dict[str, threading.Lock] = {}
_GUARD = threading.Lock()


@contextmanager
def tenant_lock(settings: Settings, tenant: str) -> Iterator[None]:
    """Hold the tenant's admission lock while the block counts and creates."""
    with _GUARD:
        lock = _LOCKS.setdefault(tenant, threading.Lock())
    folder = settings.state_dir / "locks"
    folder.mkdir(parents=True, exist_ok=True)
    with lock, open(folder / f"tenant-{tenant}", "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)  # released when the file closes
        yield
