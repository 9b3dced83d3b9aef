"""The scheduler is Prefect: this module only names and configures Prefect's own parts.

- Work pools per hardware class (`gpu`, `cpu`), process type, whose concurrency limit bounds how
  many job processes exist at once (the slots, one warming up per slot, and one more for another
  tenant's job).
- A global concurrency limit per pool, `slots-<pool>`, with one slot per GPU (or per concurrent
  CPU job): a job asking for N GPUs holds N slots for its whole life (see opentinker/orchestration/job.py).
  Slots are leases: released on completion, failure or cancellation, and expired by the server
  when a crashed job stops renewing them.
- Per tenant: a work queue in each pool, `tenant-<name>`, whose concurrency limit leaves room in
  the pool for other tenants' jobs, and the counters `held-<pool>-<name>` and `waiting-<pool>-<name>`
  (global concurrency limits used as counters) by which waiting jobs take turns: the fair-share
  rule is in opentinker/orchestration/admission.py.
- Deployments per job kind and pool, declared in `deployments/prefect.yaml`, and the flow (job
  kind) a spec runs as.
- An automation that marks Crashed a run whose heartbeats stopped before it ended (its process died
  with its worker or machine), so a lost run frees its place in the pool instead of holding it.
- The job states users see, mapped from Prefect states.

Client-safe: imports no torch.
"""

from __future__ import annotations

import contextlib
import io
import math
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import yaml

from opentinker.core.errors import reason_line
from opentinker.core.hardware import detect_gpus
from opentinker.core.settings import Settings
from opentinker.sft.spec import is_sft_spec

ROOT = Path(__file__).resolve().parents[2]
DEPLOYMENTS_FILE = ROOT / "deployments" / "prefect.yaml"
POOLS = ("gpu", "cpu")
SLOTS_HELD_TAG = "opentinker:slots-held"
# Set by a user's cancel: a run stopped by it ends CANCELLED even if Prefect records the killed
# process as crashed (SIGTERM before the engine installs its handler, e.g. while importing).
CANCEL_REQUESTED_TAG = "opentinker:cancel-requested"
AWAITING_ENV = "AwaitingEnvironment"
# The reason a job cancelled before it held its slots reads.
QUEUED_CANCEL = "cancelled while queued"
# A run waiting for its environment is parked far in the future, out of every worker's reach.
_PARKED = timedelta(days=3650)
LOST_RUNS = "opentinker: crash runs whose heartbeats stopped"
LOST_RUN_MESSAGE = "it stopped sending heartbeats: its worker or machine went away"
TINKER_TAG = "kind:tinker"  # a Tinker API session's run (opentinker/control/gateway/tinker_sessions.py)
EXPIRED = "Expired"  # the Completed state of a session that ended for want of calls (flows/tinker_session.py)


class SchedulingError(ValueError):
    """A job the pools cannot take; the message has the numbers."""


def prefect_client():
    """A synchronous Prefect client for the API the environment names (PREFECT_API_URL)."""
    from prefect.client.orchestration import get_client

    return get_client(sync_client=True)


def job_tags(tenant: str | None, job_id: str) -> list[str]:
    """The tags a job's flow runs carry: how the gateway finds a tenant's jobs."""
    return ["opentinker", *([f"tenant:{tenant}"] if tenant else []), f"job:{job_id}"]


def pool_for(num_gpus: float) -> str:
    return "gpu" if num_gpus > 0 else "cpu"


def slots_for(num_gpus: float) -> int:
    """Slots a job holds: one per (started) GPU, or one CPU slot for a CPU job."""
    return max(1, math.ceil(num_gpus))


def slot_limit(pool: str) -> str:
    return f"slots-{pool}"


def seat_pool(pool: str) -> str:
    """The seats of `pool`'s base-model worker, taken as a pool's slots are (opentinker.orchestration.base_worker)."""
    return f"{pool}-seats"


def tenant_limit(tenant: str) -> str:
    """The global concurrency limit that bounds a tenant's running jobs."""
    return f"tenant-{tenant}"


def admit_limit(pool: str) -> str:
    """A one-slot limit that serializes the decisions of jobs taking a pool's slots (a mutex)."""
    return f"admit-{pool}"


def held_limit(pool: str, tenant: str) -> str:
    """Counts the slots of `pool` that the tenant's jobs hold (taken together with the slots)."""
    return f"held-{pool}-{tenant}"


def waiting_limit(pool: str, tenant: str) -> str:
    """Counts the tenant's jobs waiting for slots of `pool` (leased: a dead waiter stops counting)."""
    return f"waiting-{pool}-{tenant}"


# The limit of the counting limits above: they count, they never refuse.
COUNTER = 1_000_000


def tenant_queue(tenant: str) -> str:
    """The tenant's work queue, in each pool."""
    return f"tenant-{tenant}"


def tenant_queue_limit(slots: int) -> int:
    """Job processes one tenant may have in a pool of `slots` slots (running, or started and waiting
    for a slot): one running and one warming up per slot, every process the pool may start but the
    one kept for another tenant's job, which so always starts and waits its turn."""
    return max(1, 2 * slots)


def ensure_tenant_queue(settings: Settings, tenant: str, pool: str) -> str:
    """Create the tenant's work queue in `pool`, sized to the pool's slots now, before its first job
    is queued there (`resize_pool` resizes it with the pool); its name."""
    from prefect.exceptions import ObjectAlreadyExists, ObjectNotFound

    name = tenant_queue(tenant)
    with prefect_client() as client:
        try:
            client.read_work_queue_by_name(name, work_pool_name=pool)
        except ObjectNotFound:
            try:
                client.create_work_queue(name=name, work_pool_name=pool, concurrency_limit=tenant_queue_limit(live_capacity(settings, pool)),
                                         description=f"jobs of tenant {tenant}")
            except ObjectAlreadyExists:  # a concurrent first submission created it
                pass
    return name


def ensure_tenant_limit(tenant: str, running: int) -> None:
    """Create (or resize) the tenant's running-jobs limit before its job is queued."""
    from prefect.exceptions import ObjectAlreadyExists

    from prefect.exceptions import ObjectNotFound

    with prefect_client() as client:
        try:
            if client.read_global_concurrency_limit_by_name(tenant_limit(tenant)).limit == running:
                return  # the usual case: one read per submission
        except ObjectNotFound:
            pass
        try:
            client.upsert_global_concurrency_limit_by_name(tenant_limit(tenant), running)
        except ObjectAlreadyExists:  # a concurrent first submission created it between Prefect's read and create
            client.upsert_global_concurrency_limit_by_name(tenant_limit(tenant), running)


def capacity(settings: Settings, pool: str) -> int:
    if pool == "gpu":
        return settings.gpu_slots if settings.gpu_slots is not None else detect_gpus()
    return settings.cpu_slots


def check_fits(settings: Settings, num_gpus: float) -> str:
    """The pool for a job; SchedulingError when the job could never be placed."""
    pool = pool_for(num_gpus)
    have, need = live_capacity(settings, pool), slots_for(num_gpus)
    if need > have:
        what = f"{num_gpus:g} GPUs" if num_gpus else "a CPU slot"
        raise SchedulingError(f"resources.num_gpus: the job asks for {what}; pool {pool!r} has {have} slot(s)")
    return pool


def ensure_pools(settings: Settings) -> None:
    """Create or resize both process pools and their slot limits to the configured capacity. The
    GPU pool, unless `gpu_slots` is set, keeps what joined GPU workers counted in the cluster
    (see opentinker/control/node.py) when that is more than this machine has."""
    for pool in POOLS:
        slots = capacity(settings, pool)
        if pool == "gpu" and settings.gpu_slots is None:
            slots = max(slots, live_capacity(settings, pool))
        resize_pool(pool, slots)
        with prefect_client() as client:  # the pool's base-model worker hosts this many Tinker sessions
            client.upsert_global_concurrency_limit_by_name(slot_limit(seat_pool(pool)), settings.tinker_worker_seats)
            client.upsert_global_concurrency_limit_by_name(admit_limit(seat_pool(pool)), 1)
    ensure_automation(lost_run_automation(settings.lost_run_after_s))


def lost_run_automation(after_s: float, name: str = LOST_RUNS, tag: str | None = None):
    """Prefect's documented answer to zombie runs: a run that sent a heartbeat and then neither another
    one nor an end state within `after_s` is set Crashed. Without it a run whose process died with its
    worker (`opentinker down`, a kill -9, a lost host) stays Running for ever and keeps its place in
    the pool's concurrency limit. `tag`: only runs with that tag (a test's own automation)."""
    from prefect.client.schemas.objects import StateType
    from prefect.events.actions import ChangeFlowRunState
    from prefect.events.schemas.automations import AutomationCore, EventTrigger, Posture
    from prefect.events.schemas.events import ResourceSpecification

    beat = "prefect.flow-run.heartbeat"
    ends = {f"prefect.flow-run.{end}" for end in ("Completed", "Failed", "Cancelled", "Crashed")}
    related = ResourceSpecification({"prefect.resource.id": f"prefect.tag.{tag}", "prefect.resource.role": "tag"}) if tag else []
    trigger = EventTrigger(after={beat}, expect={beat, *ends}, posture=Posture.Proactive, threshold=1,
                           match=ResourceSpecification({"prefect.resource.id": "prefect.flow-run.*"}), match_related=related,
                           for_each={"prefect.resource.id"}, within=timedelta(seconds=after_s))
    return AutomationCore(name=name, trigger=trigger,
                          actions=[ChangeFlowRunState(state=StateType.CRASHED, message=LOST_RUN_MESSAGE)])


def ensure_automation(automation) -> None:
    """Create `automation`, or replace the one of its name when it differs (e.g. a new `lost_run_after_s`)."""
    with prefect_client() as client:
        existing = client.read_automations_by_name(automation.name)
        fields = set(type(automation).model_fields)
        if len(existing) == 1 and existing[0].model_dump(include=fields) == automation.model_dump(include=fields):
            return
        for old in existing:
            client.delete_automation(old.id)
        client.create_automation(automation)


def resize_pool(pool: str, slots: int) -> None:
    """Create or resize `pool` and its slot limit to `slots` (the GPU pool: one per device)."""
    from prefect.client.schemas.actions import WorkPoolCreate, WorkPoolUpdate
    from prefect.exceptions import ObjectNotFound
    from prefect.workers.process import ProcessWorker

    # One waiting job per slot may start: it loads (imports, checks) while the others run, then
    # waits for a slot, so each freed slot is refilled in about a second, not after a whole
    # process start-up, even when jobs started together end together (bench/scheduler_load.py).
    # The slots bound what runs. One more process is kept for another tenant's job: one tenant's
    # queue takes at most 2 × slots (`tenant_queue_limit`), so another tenant's job can always
    # start and wait its turn.
    limit = 2 * slots + 1
    with prefect_client() as client:
        try:
            existing = client.read_work_pool(pool)
        except ObjectNotFound:
            client.create_work_pool(WorkPoolCreate(
                name=pool, type="process", concurrency_limit=limit,
                base_job_template=ProcessWorker.get_default_base_job_template(),
                description=f"OpenTinker {pool} jobs: {slots} slots",
            ))
        else:
            if existing.type != "process":
                raise SchedulingError(f"work pool {pool!r} has type {existing.type!r}, not 'process'")
            if existing.concurrency_limit != limit:
                client.update_work_pool(pool, WorkPoolUpdate(concurrency_limit=limit))
        client.upsert_global_concurrency_limit_by_name(slot_limit(pool), slots)
        client.upsert_global_concurrency_limit_by_name(admit_limit(pool), 1)
        for queue in client.read_work_queues(work_pool_name=pool):  # tenants' queues follow the pool's size
            if queue.name.startswith("tenant-") and queue.concurrency_limit != tenant_queue_limit(slots):
                client.update_work_queue(queue.id, concurrency_limit=tenant_queue_limit(slots))


def live_capacity(settings: Settings, pool: str) -> int:
    """The pool's slots as the scheduler holds them now (GPU workers that joined set the GPU pool's
    to the cluster's devices); the configured capacity when the limit does not exist yet."""
    from prefect.exceptions import ObjectNotFound

    with prefect_client() as client:
        try:
            return int(client.read_global_concurrency_limit_by_name(slot_limit(pool)).limit)
        except ObjectNotFound:
            return capacity(settings, pool)


def load_deployments(path: Path = DEPLOYMENTS_FILE) -> list[dict[str, Any]]:
    return list(yaml.safe_load(path.read_text())["deployments"])


def deployment_names(path: Path = DEPLOYMENTS_FILE) -> list[str]:
    """`<flow>/<name>` of every deployment in the YAML (flow names are the function names with
    dashes: `flows.rl_train:rl_train` is the flow `rl-train`), without importing the flows."""
    return [f"{e['entrypoint'].partition(':')[2].replace('_', '-')}/{e['name']}" for e in load_deployments(path)]


def deployment_name(kind: str, pool: str) -> str:
    return f"{kind}/{pool}"


def flow_for(spec_data: dict[str, Any]) -> str:
    """The flow (job kind) that runs a spec: sft for a `data` section without `env`, self-play
    when it has a multiagent section."""
    if is_sft_spec(spec_data):
        return "sft"
    return "self-play" if spec_data.get("multiagent") else "rl-train"


def apply_deployments(settings: Settings, path: Path = DEPLOYMENTS_FILE) -> list[str]:
    """Register every deployment of `deployments/prefect.yaml`; returns their names.

    Entrypoints are module paths (`flows.rl_train:rl_train`), not file paths: Ray workers
    unpickle task context by module name, and `flows` is a package of this project.
    """
    import importlib

    from prefect.deployments.runner import EntrypointType

    names = []
    for entry in load_deployments(path):
        module, _, attr = entry["entrypoint"].partition(":")
        flow = getattr(importlib.import_module(module), attr)
        with contextlib.redirect_stdout(io.StringIO()):  # deploy() prints a table meant for its CLI
            flow.deploy(
                name=entry["name"], work_pool_name=entry["work_pool"]["name"], build=False, push=False,
                print_next_steps=False, ignore_warnings=True, description=entry.get("description"),
                tags=entry.get("tags"), entrypoint_type=EntrypointType.MODULE_PATH,
                # The gateway validates specs itself, and a run parked for its environment
                # carries an incomplete spec until fit() completes it.
                enforce_parameter_schema=False,
                schedules=_schedules(entry), triggers=_triggers(entry),
                concurrency_limit=entry.get("concurrency_limit"), parameters=entry.get("parameters"),
            )
        names.append(f"{flow.name}/{entry['name']}")
    return names


def _schedules(entry: dict[str, Any]) -> list[Any] | None:
    """prefect.yaml `schedules:` entries (cron or interval, timezone, active, parameters, slug) as
    Prefect schedules; None when the deployment has none (re-applying then keeps no schedule)."""
    from prefect.schedules import Cron, Interval

    out = []
    for item in entry.get("schedules") or []:
        extra = {k: item[k] for k in ("timezone", "active", "parameters", "slug") if k in item}
        if "cron" in item:
            out.append(Cron(item["cron"], **extra))
        elif "interval" in item:
            out.append(Interval(item["interval"], **extra))
        else:
            raise ValueError(f"deployment {entry['name']!r}: a schedule needs `cron` or `interval`, got {item}")
    return out or None


def _triggers(entry: dict[str, Any]) -> list[Any] | None:
    """prefect.yaml `triggers:` entries, validated the way `prefect deploy` does (each becomes an
    automation owned by the deployment, replaced whenever the deployment is applied again)."""
    from pydantic import TypeAdapter
    from prefect.events import DeploymentTriggerTypes

    adapter = TypeAdapter(DeploymentTriggerTypes)
    specs = entry.get("triggers") or []
    prefix = f"{entry['entrypoint'].partition(':')[2].replace('_', '-')}/{entry['name']}"
    return [adapter.validate_python({"name": f"{prefix} trigger {i}", **t}) for i, t in enumerate(specs, 1)] or None


def deployment_exists(name: str) -> bool:
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound

    with get_client(sync_client=True) as client:
        try:
            client.read_deployment_by_name(name)
            return True
        except ObjectNotFound:
            return False


def parked_state():
    """The Prefect state of a submitted job whose environment is not known yet."""
    from prefect.states import Scheduled

    return Scheduled(scheduled_time=datetime.now(timezone.utc) + _PARKED, name=AWAITING_ENV)


# --- job states --------------------------------------------------------------------------------

def job_state(flow_run: Any) -> tuple[str, str | None]:
    """(user-facing state, reason) of a job's flow run.

    QUEUED: scheduled, pending, parked for its environment, or started but still waiting for
    its slots; RUNNING: holding its slots (or cancelling); the rest are terminal. A job cancelled
    before it held its slots is CANCELLED at once, even while the process Prefect had started
    for it is still on its way out (it never runs the job: opentinker/orchestration/admission.py).
    """
    state = flow_run.state
    if state is None:
        return "QUEUED", None
    kind, name, message = state.type.value, state.name, state.message
    tags = flow_run.tags or []
    if CANCEL_REQUESTED_TAG in tags and SLOTS_HELD_TAG not in tags and kind in ("SCHEDULED", "PENDING", "PAUSED", "RUNNING", "CANCELLING"):
        return "CANCELLED", QUEUED_CANCEL
    if kind == "SCHEDULED" and name == AWAITING_ENV:
        return "QUEUED", "waiting for the environment: call ServiceClient.fit()"
    if kind in ("SCHEDULED", "PENDING", "PAUSED"):
        return "QUEUED", message or "waiting for a worker"
    if kind == "RUNNING":
        if SLOTS_HELD_TAG in (flow_run.tags or []):
            return "RUNNING", None
        return "QUEUED", "waiting for slots"
    if kind == "CANCELLING":
        return "RUNNING", "cancelling"
    if kind == "COMPLETED":
        return "COMPLETED", message if name == EXPIRED else None
    if kind == "CANCELLED":
        return "CANCELLED", message
    if CANCEL_REQUESTED_TAG in (flow_run.tags or []):  # the stop the cancel sent ended the process (Crashed) or its job (Failed)
        return "CANCELLED", "cancelled" if kind == "CRASHED" else f"cancelled (it failed as it stopped: {reason_line(message) or name})"
    if kind == "CRASHED":
        return "FAILED", crash_line(flow_run, reason_line(message) or name)
    return "FAILED", reason_line(message) or name


def crash_line(flow_run: Any, cause: str) -> str:
    """A run whose process died under it (Prefect: "Process exited with status code: 1") says what
    that means and what to do: the job's checkpoints outlive its process. A Tinker session is not
    resubmitted: its client goes on in a new session from a state it saved."""
    if TINKER_TAG in (flow_run.tags or []):
        from opentinker.tinker.paths import RESUME

        return f"its process died ({cause.rstrip('.')}): killed, out of memory, the stack stopped, or its Ray node or head went away; {RESUME}"
    job = next((tag.removeprefix("job:") for tag in flow_run.tags or [] if tag.startswith("job:")), None)
    again = f"; resubmit job {job} to resume from its last complete checkpoint" if job else ""
    return f"the job's process died ({cause.rstrip('.')}): killed, out of memory, or its Ray node or head went away{again}"
