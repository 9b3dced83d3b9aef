"""A job's concurrency slots, held under a Prefect lease that outlives a control-plane restart.

Prefect's `concurrency()` renews its lease from a thread whose client, until its first answer,
does not retry a refused connection, and it gives up after three tries within about three
seconds; with `strict` a failed renewal cancels the run, and the release on the way out then
fails too. A Prefect server restarted mid-job so failed the job with a bare "ConnectError" (CI).
Here each call to Prefect rides out blips (`through_blips`), a renewal that still fails is
logged and the job goes on (Ray's resources still bound what runs on a GPU), and the release is
best effort: an unreleased lease expires `lease_s` after its last renewal.

The calls are the Prefect client's own lease endpoints (increment-with-lease, renew,
decrement-with-lease), the ones `concurrency()` is built on. `leased_slots` waits for its slots;
`try_lease` asks once (for several limits at once, all or none) and `kept_lease` holds what it got,
for callers that decide themselves when to ask (admission.py: turns between tenants, cancels).
"""

from __future__ import annotations

import contextvars
import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from uuid import UUID

from opentinker.control.scheduler import prefect_client
from opentinker.core.polling import through_blips, wait_for

_LOCKED = 423  # the limit is full


@dataclass
class SlotLease:
    """What the holder can see of its lease: how often it was renewed, and why it was lost."""

    limit: str
    lease_id: UUID
    renewals: int = 0
    lost: str | None = None


@contextmanager
def leased_slots(limit: str, occupy: int, *, lease_s: float, blip_s: float, renew_every_s: float | None = None,
                 logger: logging.Logger | logging.LoggerAdapter | None = None) -> Iterator[SlotLease]:
    """Wait for `occupy` slots of the global concurrency limit `limit` (which must exist), hold
    them while the block runs, renewing the lease every `renew_every_s` (a third of `lease_s`)."""
    lease_id = through_blips(lambda: _acquire(limit, occupy, lease_s), give_up_after_s=blip_s)
    with kept_lease(lease_id, limit, lease_s=lease_s, blip_s=blip_s, renew_every_s=renew_every_s, logger=logger) as lease:
        yield lease


@contextmanager
def kept_lease(lease_id: UUID, limit: str, *, lease_s: float, blip_s: float, renew_every_s: float | None = None,
               logger: logging.Logger | logging.LoggerAdapter | None = None) -> Iterator[SlotLease]:
    """Hold a granted lease (`try_lease`) while the block runs: renewed every `renew_every_s` (a
    third of `lease_s`), released on the way out (best effort: it expires on its own)."""
    log = logger or logging.getLogger(__name__)
    lease = SlotLease(limit, lease_id)
    stop = threading.Event()
    context = contextvars.copy_context()  # the caller's Prefect settings (API URL) hold in the keeper too
    keeper = threading.Thread(target=context.run, args=(_keep, lease, lease_s, renew_every_s or lease_s / 3, blip_s, stop, log),
                              name=f"slot-lease-{limit}", daemon=True)
    keeper.start()
    try:
        yield lease
    finally:
        stop.set()
        keeper.join(timeout=5)
        try:
            through_blips(lambda: release_lease(lease.lease_id), give_up_after_s=min(blip_s, 30.0))
        except Exception as err:  # noqa: BLE001 - the lease expires on its own; the job's outcome stands
            log.warning(f"could not release the slots of {limit!r} ({type(err).__name__}: {err}); they free "
                        f"themselves when the lease expires, {lease_s:g}s after its last renewal")


def _acquire(limit: str, occupy: int, lease_s: float) -> UUID:
    """The lease id once the slots are granted, asking again each second while the limit is full
    (the stack and infra/ cap Prefect's Retry-After at a second)."""
    return wait_for(lambda: try_lease([limit], occupy, lease_s), interval=1.0, what=f"slots of {limit!r}")


def try_lease(limits: list[str], occupy: int, lease_s: float) -> UUID | None:
    """One try: `occupy` slots of every limit in `limits` at once (all or none; each must exist),
    under one lease held by this flow run; None when one of them is full."""
    from httpx import HTTPStatusError
    from prefect import runtime
    from prefect.client.schemas.objects import ConcurrencyLeaseHolder
    from prefect.client.schemas.responses import ConcurrencyLimitWithLeaseResponse

    run_id = runtime.flow_run.id  # the UI shows which run holds the slots
    holder = ConcurrencyLeaseHolder(type="flow_run", id=UUID(run_id)) if run_id else None
    with prefect_client() as client:
        try:
            response = client.increment_concurrency_slots_with_lease(names=limits, slots=occupy, mode="concurrency",
                                                                     lease_duration=lease_s, holder=holder)
        except HTTPStatusError as err:
            if err.response.status_code == _LOCKED:
                return None
            raise
    granted = ConcurrencyLimitWithLeaseResponse.model_validate(response.json())
    missing = set(limits) - {limit.name for limit in granted.limits}
    if missing:
        if granted.limits:
            release_lease(granted.lease_id)
        raise LookupError(f"the concurrency limit {min(missing)!r} does not exist (the scheduler creates it: `opentinker deploy`)")
    return granted.lease_id


def _keep(lease: SlotLease, lease_s: float, every_s: float, blip_s: float, stop: threading.Event, log) -> None:
    while not stop.wait(every_s):
        try:
            through_blips(lambda: _renew(lease.lease_id, lease_s), give_up_after_s=blip_s)
            lease.renewals += 1
        except Exception as err:  # noqa: BLE001 - logged; the job goes on without its reservation
            if stop.is_set():
                return
            lease.lost = f"{type(err).__name__}: {err}"
            log.warning(f"the lease on the slots of {lease.limit!r} could not be renewed ({lease.lost}); the job goes on, "
                        "but the scheduler may now give its slots to another job")
            return


def _renew(lease_id: UUID, lease_s: float) -> None:
    with prefect_client() as client:
        client.renew_concurrency_lease(lease_id=lease_id, lease_duration=lease_s)


def release_lease(lease_id: UUID) -> None:
    with prefect_client() as client:
        client.release_concurrency_slots_with_lease(lease_id=lease_id)
