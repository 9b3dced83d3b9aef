"""How much of the gateway the console may take: a session's requests at once, and all sessions'.

The gateway is one asyncio process shared with the tenant API and `/v1/health`, and every console
read calls Prefect and MLflow, which the API calls too. Unbounded, 200 page loads at once took
every thread of the pool the API's routes run in and queued behind each other at Prefect: the
API answered 175× slower and health in 29 s at p95 (bench/console_load.py, its before). So:

- a session may have `in_flight` console requests; one more is answered 429 with Retry-After at
  once (the page's script tries again at its next poll; a person reloads);
- the console starts at most `per_s` requests a second, all sessions together, in turn (a page
  load is 2-3 of them, an open tab polls about one a second): a request served from what was
  kept still costs the event loop a few milliseconds, and 200 loads at once would keep it busy;
- a read that asks Prefect or MLflow (an answer not kept in recent.py) takes one of its
  session's `per_session` read slots, then a place in the console's line of `reads` (all sessions
  together), and runs on the console's own `reads` threads, never on the pool the API uses; an
  answer already kept, or being read for someone else, takes neither. After each read the line
  rests `rest` × as long as the read took, since Prefect and MLflow answer the API too: one read
  at a time, resting as long (the defaults), keeps the API within 2× its time alone under 200
  page loads (bench/console_load.py);
- rendering a page or JSON (CPU on the event loop) waits in a line of `renders`, so that a burst
  of answers does not hold up `/v1/health` behind it;
- every wait is first come, first served, and a request that has waited `wait_s` in all is
  answered 429 with Retry-After.

A session stands in the line of reads with at most `per_session` reads, and in the line of
renders with at most `in_flight` requests, so one busy session cannot push the others far back.
"""

from __future__ import annotations

import asyncio
import contextvars
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from typing import Any, TypeVar

T = TypeVar("T")
_request: contextvars.ContextVar[tuple[str, float] | None] = contextvars.ContextVar("console_request", default=None)  # session, deadline


class Busy(Exception):
    """The console cannot take this request now: answered 429, retry after `retry_after_s`."""

    def __init__(self, message: str, retry_after_s: int):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class Pace:
    """At most `per_s` starts a second, spaced evenly, first come first served."""

    def __init__(self, per_s: float):
        self.gap_s, self.next_s = 1.0 / per_s, 0.0

    async def take(self, timeout_s: float) -> bool:
        """True at this caller's turn; False at once if that turn is more than `timeout_s` away."""
        now = time.monotonic()
        start = max(now, self.next_s)
        if start - now > timeout_s:
            return False
        self.next_s = start + self.gap_s
        if start > now:
            await asyncio.sleep(start - now)
        return True


class Slots:
    """`size` slots taken first come, first served; a waiter that gives up leaves the line."""

    def __init__(self, size: int):
        self.size, self.taken = size, 0
        self.waiting: deque[asyncio.Future] = deque()

    async def take(self, timeout_s: float) -> bool:
        """True once a slot is this caller's; False after `timeout_s` without one."""
        if self.taken < self.size and not self.waiting:
            self.taken += 1
            return True
        turn = asyncio.get_running_loop().create_future()
        self.waiting.append(turn)
        try:
            await asyncio.wait_for(asyncio.shield(turn), timeout_s)
            return True
        except asyncio.TimeoutError:
            self._leave(turn)
            return False
        except BaseException:
            self._leave(turn)
            raise

    def _leave(self, turn: asyncio.Future) -> None:
        if turn.done() and not turn.cancelled():
            self.give()  # handed over just as the wait ended: pass it on
        else:
            turn.cancel()
            self.waiting.remove(turn)

    def give(self) -> None:
        while self.waiting:
            turn = self.waiting.popleft()
            if not turn.done():
                turn.set_result(None)  # the slot goes straight to the next in line
                return
        self.taken -= 1


class ReadBounds:
    """Per-session admission and read slots, shared lines for reads and renders, and the console's
    own threads."""

    def __init__(self, per_session: int = 1, reads: int = 1, renders: int = 2, in_flight: int = 16, per_s: float = 50,
                 rest: float = 1.0, wait_s: float = 10.0):
        self.per_session, self.in_flight, self.rest, self.wait_s = per_session, in_flight, rest, wait_s
        self.pace = Pace(per_s)
        self.reads, self.renders = Slots(reads), Slots(renders)
        self.threads = ThreadPoolExecutor(max_workers=reads, thread_name_prefix="console")
        self._sessions: dict[str, Slots] = {}  # each session's read slots
        self._inside: dict[str, int] = {}  # each session's requests in flight

    def inside(self, session: str) -> int:
        return self._inside.get(session, 0)

    @asynccontextmanager
    async def request(self, session: str) -> AsyncIterator[None]:
        """Admits a request of `session` for the block (Busy at once when it has `in_flight`
        already); the block's waits for slots end together, `wait_s` from now."""
        if self.inside(session) >= self.in_flight:
            raise Busy(f"this session has {self.inside(session)} console requests in flight; wait for them", 2)
        self._inside[session] = self.inside(session) + 1
        self._sessions.setdefault(session, Slots(self.per_session))
        token = _request.set((session, time.monotonic() + self.wait_s))
        try:
            if not await self.pace.take(self.wait_s):
                raise Busy("the console is busy with other sessions", 2)
            yield
        finally:
            _request.reset(token)
            self._inside[session] -= 1
            if not self._inside[session]:
                del self._inside[session], self._sessions[session]

    def _left(self) -> tuple[str | None, float]:
        session, deadline = _request.get() or (None, time.monotonic() + self.wait_s)
        return session, max(0.0, deadline - time.monotonic())

    @asynccontextmanager
    async def reading(self) -> AsyncIterator[None]:
        """A slot of the request's session and a place in the shared line of reads, for the block;
        Busy once the request has waited its time."""
        session, left = self._left()
        own = self._sessions.get(session) if session is not None else None
        if own is not None and not await own.take(left):
            raise Busy("this session's reads are still being answered", 2)
        try:
            if not await self.reads.take(self._left()[1]):
                raise Busy("the console is busy with other sessions", 2)
            began = time.monotonic()
            try:
                yield
            finally:  # the line rests `rest` × as long as the read took: Prefect and MLflow are the API's too
                if (rest_s := (time.monotonic() - began) * self.rest) > 0:
                    asyncio.get_running_loop().call_later(rest_s, self.reads.give)
                else:
                    self.reads.give()
        finally:
            if own is not None:
                own.give()

    @asynccontextmanager
    async def rendering(self) -> AsyncIterator[None]:
        """A place in the shared line of renders (CPU on the event loop) for the block."""
        if not await self.renders.take(self._left()[1]):
            raise Busy("the console is busy with other sessions", 2)
        try:
            yield
        finally:
            self.renders.give()

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` (a read of Prefect or MLflow) on the console's threads, holding a place as
        `reading` does: its parsing too stays off the gateway's event loop."""
        async with self.reading():  # in this context, as asyncio.to_thread runs it (Prefect's settings live there)
            return await asyncio.get_running_loop().run_in_executor(self.threads, contextvars.copy_context().run, fn, *args)
