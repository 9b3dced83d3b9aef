"""Console answers kept a second or two, per tenant, and read once however many ask at once.

Many tabs poll the same jobs list and the same job every 2-3 s; each read asks Prefect and MLflow
a dozen questions. An answer is kept `ttl_s` seconds under a key that starts with the tenant it
was read for (None: the operator, whom no tenant name can equal), so one tenant's rows are never
answered to another. While a key is being read, everyone else asking for it waits for that read
instead of making their own, or, when there is an answer before it not over `STALE_S` old, gets
that one at once: under load a page shows what it showed a few seconds ago rather than wait or
fail. Only answers are kept: a failure (no such job) is read again. A job that ended a while ago
no longer changes: what was read of it is kept `SETTLED_KEEP_S`.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Awaitable, Callable
from datetime import datetime, timezone
from typing import Any

from opentinker.control.console.listing import SETTLED_S  # an ended job's metrics are all in after this

CACHE_S = float(os.environ.get("OPENTINKER_CONSOLE_CACHE_S", "2"))  # lists and pages
LIVE_S = min(CACHE_S, 1.0)  # a job's curves and logs, polled every 2-3 s
SETTLED_KEEP_S = 30.0 if CACHE_S > 0 else 0.0  # what was read of such a job (a re-submitted id shows within this)
STALE_S = 30.0  # an answer being read again is given in its place until it is this old
MAX_KEPT = 256  # answers (a job's curves can be large): the oldest go first

Keep = float | Callable[[Any], float]  # seconds, or seconds for the answer read


def settled(job: dict[str, Any]) -> bool:
    """Whether a job (a status: state, ended) ended over SETTLED_S ago: nothing of it changes now."""
    if job.get("state") not in ("COMPLETED", "FAILED", "CANCELLED") or not job.get("ended"):
        return False
    ended = datetime.fromisoformat(str(job["ended"]))
    ended = ended if ended.tzinfo else ended.replace(tzinfo=timezone.utc)
    return (datetime.now(timezone.utc) - ended).total_seconds() > SETTLED_S


def job_keep(live_s: float) -> Callable[[dict[str, Any]], float]:
    """How long to keep an answer about a job ({"job": its status, ...}): `live_s`, or
    SETTLED_KEEP_S once it has settled."""
    return lambda answer: SETTLED_KEEP_S if settled(answer["job"]) else live_s


def logs_keep(answer: dict[str, Any]) -> float:
    """A page of log lines: LIVE_S, or SETTLED_KEEP_S once the log is complete (no line will join it)."""
    return SETTLED_KEEP_S if answer["complete"] else LIVE_S


class Recent:
    def __init__(self, max_kept: int = MAX_KEPT):
        self.max_kept = max_kept
        self._kept: dict[tuple, tuple[float, float, Any]] = {}  # key -> (fresh until, usable until, answer)
        self._reading: dict[tuple, asyncio.Future] = {}

    async def get(self, tenant: str | None, key: tuple, ttl_s: Keep, read: Callable[[], Awaitable[Any]]) -> Any:
        """The tenant's answer for `key`: kept from the last `ttl_s` seconds, else read by `read()`;
        while it is being read again, the one before it (at most STALE_S old) at once."""
        full, now = (tenant, *key), time.monotonic()
        kept = self._kept.get(full)
        if kept and now < kept[0]:
            return kept[2]
        if (pending := self._reading.get(full)) is not None:
            if kept and now < kept[1]:
                return kept[2]
            return await asyncio.shield(pending)
        pending = self._reading[full] = asyncio.ensure_future(read())
        pending.add_done_callback(lambda done: self._done(full, done, ttl_s))
        return await asyncio.shield(pending)  # a caller that goes away leaves the read to the others

    def _done(self, key: tuple, done: asyncio.Future, ttl_s: Keep) -> None:
        if self._reading.get(key) is done:
            del self._reading[key]
        if done.cancelled() or done.exception() is not None:
            return
        if (seconds := ttl_s(done.result()) if callable(ttl_s) else ttl_s) > 0:
            now = time.monotonic()
            self._keep(key, now + seconds, now + max(seconds, STALE_S), done.result())

    def _keep(self, key: tuple, fresh: float, usable: float, answer: Any) -> None:
        self._kept.pop(key, None)
        if len(self._kept) >= self.max_kept:
            now = time.monotonic()
            self._kept = {k: v for k, v in self._kept.items() if v[1] > now}
            while len(self._kept) >= self.max_kept:
                del self._kept[next(iter(self._kept))]  # the oldest kept
        self._kept[key] = (fresh, usable, answer)

    def forget(self, tenant: str | None) -> None:
        """Drops the tenant's kept answers (after it changed something: a cancel)."""
        self._kept = {k: v for k, v in self._kept.items() if k[0] != tenant}
