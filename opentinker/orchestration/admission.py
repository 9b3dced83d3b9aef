"""How a scheduled job gets its slots: it waits its turn, fairly between tenants, and a cancel
while it waits ends it CANCELLED without running anything.

A job's flow run is a process the worker started. Before it runs anything it holds one slot of
its tenant's running limit `tenant-<name>` (OPENTINKER_TENANT_MAX_RUNNING) and its slots of the
pool's `slots-<pool>`, leased for its whole life (scheduler.py); until then it waits here, asking
Prefect every second, and the user sees it QUEUED.

**Fair share between tenants (the rule).** While jobs of several tenants wait for a pool:

- *Processes.* A tenant's jobs wait in the tenant's own work queue of the pool (`tenant-<name>`),
  whose concurrency limit (2 × slots: one running and one warming up per slot) is every process the
  pool may start (2 × slots + 1) but one; a tenant's backlog never holds every process, so another
  tenant's job always starts and waits its turn.
  Each time a tenant's job gets its slots its queue moves to the back of the pool's queue order,
  so the worker next starts a job of the tenant that got slots least recently (round robin).
- *Slots.* A free slot goes to the waiting job whose tenant holds the fewest slots of the pool
  (tenants holding as many: whichever asks first). A job whose tenant holds more slots than
  another tenant with a job waiting lets that job go first, for up to DEFER_S seconds of the slot
  standing free (past that the other job needs more slots than are free, or is stuck, and the
  slot is not left idle). A tenant alone uses every slot; nothing running is ever preempted.

So a tenant's backlog takes no freed slot while another tenant's job waits holding fewer: with 2
slots and tenant A's backlog holding both, tenant B's job takes the first slot A frees, and the
two then alternate. Counts come from Prefect: `held-<pool>-<name>` (slots a tenant's jobs hold,
taken in the same call as the pool's slots) and `waiting-<pool>-<name>` (jobs waiting, leased, so
a waiter that died stops counting within a lease); decisions are serialized by the pool's one-slot
limit `admit-<pool>`, so each decision sees the one before. Jobs without a tenant (the operator's,
the nightly evaluation) just take free slots.

**Cancel while queued.** The gateway tags the run (`CANCEL_REQUESTED_TAG`) and sets it Cancelled
when it holds no slots (scheduler.job_state reads it CANCELLED from then on). A waiting job looks
for that every second; a process that starts after the cancel (it was Pending: Prefect then lets
the engine move the run back to Running) looks before it takes anything; a job that got its slots
in the same instant looks once more right after, and lets them go. Each ends the run Cancelled and
leaves through Prefect's `Abort` (the engine records no other state; the process exits 0). A job
that went on running anyway (the gateway's cancel raced with the grant) sees the cancel within
WATCH_S and moves its run to Cancelling, which the worker stops as any running job.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from uuid import UUID

from opentinker.control.scheduler import (CANCEL_REQUESTED_TAG, COUNTER, QUEUED_CANCEL, SLOTS_HELD_TAG, admit_limit, held_limit,
                                          prefect_client, slot_limit, tenant_limit, tenant_queue, waiting_limit)
from opentinker.core.polling import through_blips
from opentinker.orchestration.slot_lease import kept_lease, release_lease, try_lease

POLL_S = 1.0
DEFER_S = 30.0
WATCH_S = 15.0
# A decision under `admit-<pool>` takes well under a second; Prefect's shortest lease is a minute.
_MUTEX_LEASE_S = 60.0

Log = logging.Logger | logging.LoggerAdapter


@contextmanager
def admitted(pool: str, need: int, tenant: str | None, *, lease_s: float, blip_s: float, log: Log) -> Iterator[None]:
    """Wait for `need` slots of `pool` (and, for a tenant's job, first a slot of its running limit),
    taking turns with other tenants; hold them while the block runs. Raises prefect's Abort, the run
    left Cancelled, when the job is cancelled before it holds them."""
    from prefect import runtime

    run_id = str(runtime.flow_run.id)
    keep = {"lease_s": lease_s, "blip_s": blip_s, "logger": log}
    with ExitStack() as held:
        if tenant:
            _ensure_counters(pool, tenant)
            lease = _wait(lambda: try_lease([tenant_limit(tenant)], 1, lease_s), run_id, blip_s, log)
            held.enter_context(kept_lease(lease, tenant_limit(tenant), **keep))
            turn = _Turn(pool, tenant, need, log)
            waiting = through_blips(lambda: try_lease([waiting_limit(pool, tenant)], 1, lease_s), give_up_after_s=blip_s)
            with kept_lease(waiting, waiting_limit(pool, tenant), **keep):  # counted as waiting until the slots are ours
                lease = _wait(lambda: turn.take(lease_s), run_id, blip_s, log)
        else:
            lease = _wait(lambda: try_lease([slot_limit(pool)], need, lease_s), run_id, blip_s, log)
        held.enter_context(kept_lease(lease, slot_limit(pool), **keep))
        through_blips(lambda: _tag(run_id, SLOTS_HELD_TAG), give_up_after_s=blip_s)
        through_blips(lambda: stop_if_cancelled(run_id, log), give_up_after_s=blip_s)  # a cancel that raced the grant
        if tenant:
            _to_back_of_line(pool, tenant, log)
        held.enter_context(_watched(run_id, log))
        yield


def stop_if_cancelled(run_id: str, log: Log) -> None:
    """Abort (the run left Cancelled) when the job was cancelled; Abort too when the run already
    ended some other way (marked in the UI): there is nothing left to run."""
    from prefect.exceptions import Abort
    from prefect.states import Cancelled

    with prefect_client() as client:
        run = client.read_flow_run(run_id)
        state = run.state
        if CANCEL_REQUESTED_TAG in (run.tags or []) or (state is not None and (state.is_cancelling() or state.is_cancelled())):
            if not (state is not None and state.is_cancelled()):
                client.set_flow_run_state(run_id, Cancelled(message=QUEUED_CANCEL), force=True)
            log.info("the job was cancelled before it held its slots: it ends without running")
            raise Abort(QUEUED_CANCEL)
        if state is not None and state.is_final():
            raise Abort(f"the run already ended ({state.name})")


def _wait(try_once: Callable[[], UUID | None], run_id: str, blip_s: float, log: Log) -> UUID:
    """`try_once()` every POLL_S until it grants a lease, looking for a cancel before each try."""
    while True:
        through_blips(lambda: stop_if_cancelled(run_id, log), give_up_after_s=blip_s)
        lease = through_blips(try_once, give_up_after_s=blip_s)
        if lease is not None:
            return lease
        time.sleep(POLL_S)


@dataclass
class _View:
    """The pool as the counters read now: free slots, and per tenant slots held and jobs waiting."""

    free: int
    held: dict[str, int] = field(default_factory=dict)
    waiting: dict[str, int] = field(default_factory=dict)


def _view(pool: str) -> _View:
    held_prefix, waiting_prefix = held_limit(pool, ""), waiting_limit(pool, "")
    view, found = _View(free=0), False
    with prefect_client() as client:
        offset, page = 0, 200
        while True:
            limits = client.read_global_concurrency_limits(limit=page, offset=offset)
            for limit in limits:
                if limit.name == slot_limit(pool):
                    view.free, found = int(limit.limit) - int(limit.active_slots), True
                elif limit.name.startswith(held_prefix):
                    view.held[limit.name.removeprefix(held_prefix)] = int(limit.active_slots)
                elif limit.name.startswith(waiting_prefix):
                    view.waiting[limit.name.removeprefix(waiting_prefix)] = int(limit.active_slots)
            if len(limits) < page:
                break
            offset += page
    if not found:
        raise LookupError(f"the concurrency limit {slot_limit(pool)!r} does not exist (the scheduler creates it: `opentinker deploy`)")
    return view


class _Turn:
    """One waiting job's tries for its slots under the fair-share rule (see the module's text)."""

    def __init__(self, pool: str, tenant: str, need: int, log: Log):
        self.pool, self.tenant, self.need, self.log = pool, tenant, need, log
        self.deferring_since: float | None = None
        self.told: tuple[str, ...] = ()

    def take(self, lease_s: float) -> UUID | None:
        if not self._my_turn(_view(self.pool)):
            return None
        mutex = try_lease([admit_limit(self.pool)], 1, _MUTEX_LEASE_S)
        if mutex is None:  # another job is deciding now
            return None
        try:
            if not self._my_turn(_view(self.pool)):  # what that decision changed
                return None
            return try_lease([slot_limit(self.pool), held_limit(self.pool, self.tenant)], self.need, lease_s)
        finally:
            through_blips(lambda: release_lease(mutex), give_up_after_s=30.0)

    def _my_turn(self, view: _View) -> bool:
        if view.free < self.need:
            self.deferring_since = None
            return False
        mine = view.held.get(self.tenant, 0)
        ahead = tuple(sorted(t for t, n in view.waiting.items() if n > 0 and t != self.tenant and view.held.get(t, 0) < mine))
        if not ahead:
            self.deferring_since = None
            return True
        now = time.monotonic()
        self.deferring_since = self.deferring_since or now
        if ahead != self.told:
            self.told = ahead
            self.log.info(f"a slot of {self.pool!r} is free; tenant {self.tenant} holds {mine} and lets the waiting job of "
                          f"{', '.join(ahead)} (holding fewer) take it first")
        return now - self.deferring_since >= DEFER_S


def _ensure_counters(pool: str, tenant: str) -> None:
    """The tenant's counters in `pool` and the pool's decision mutex, created on first use."""
    from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate
    from prefect.exceptions import ObjectAlreadyExists, ObjectNotFound

    wanted = {held_limit(pool, tenant): COUNTER, waiting_limit(pool, tenant): COUNTER, admit_limit(pool): 1}
    with prefect_client() as client:
        for name, limit in wanted.items():
            try:
                client.read_global_concurrency_limit_by_name(name)
            except ObjectNotFound:
                try:
                    client.create_global_concurrency_limit(GlobalConcurrencyLimitCreate(name=name, limit=limit))
                except ObjectAlreadyExists:  # another job of the tenant created it meanwhile
                    pass


def _tag(run_id: str, tag: str) -> None:
    with prefect_client() as client:
        run = client.read_flow_run(run_id)
        if tag not in run.tags:
            client.update_flow_run(run.id, tags=[*run.tags, tag])


def _to_back_of_line(pool: str, tenant: str, log: Log) -> None:
    """Move the tenant's work queue after every other queue of the pool (round robin between tenants)."""
    try:
        with prefect_client() as client:
            queues = client.read_work_queues(work_pool_name=pool)
            mine = next((q for q in queues if q.name == tenant_queue(tenant)), None)
            last = max((q.priority for q in queues), default=0)
            if mine is not None and mine.priority != last:
                client.update_work_queue(mine.id, priority=last + 1)
    except Exception as err:  # noqa: BLE001 - only the order of later starts depends on it
        log.warning(f"could not move the work queue of tenant {tenant} to the back ({type(err).__name__}: {err})")


@contextmanager
def _watched(run_id: str, log: Log) -> Iterator[None]:
    """While the job runs: a cancel that reached the run without stopping it (the gateway set it
    Cancelled in the instant the job took its slots) moves the run to Cancelling, which the worker
    stops like any running job."""
    from prefect.states import Cancelling

    stop = threading.Event()

    def watch() -> None:
        while not stop.wait(WATCH_S):
            try:
                with prefect_client() as client:
                    run = client.read_flow_run(run_id)
                    state = run.state
                    if state is None or state.is_cancelling():
                        continue
                    if CANCEL_REQUESTED_TAG in run.tags or state.is_cancelled():
                        if CANCEL_REQUESTED_TAG not in run.tags:
                            client.update_flow_run(run.id, tags=[*run.tags, CANCEL_REQUESTED_TAG])
                        log.info("the job was cancelled as it took its slots: stopping it")
                        client.set_flow_run_state(run_id, Cancelling(message="cancelled"), force=True)
                        return
            except Exception as err:  # noqa: BLE001 - best effort; the next look tries again
                log.debug(f"could not look for a cancel ({type(err).__name__}: {err})")

    import contextvars

    context = contextvars.copy_context()  # the caller's Prefect settings hold in the watcher too
    watcher = threading.Thread(target=context.run, args=(watch,), name="cancel-watch", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        stop.set()
