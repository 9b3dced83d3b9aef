"""What every job flow shares: the Ray task runner, the job's slots, the start-up checks, its
MLflow run (finished or failed with the job), the one-line failure reason, and registration.

A failure inside a job reaches the user as one line, the exception's message and where it arose
(`RuntimeError: boom (at game.step:12)`, without colour codes or the worker's paths); the full
traceback, Ray's included, goes to the flow run's logs.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from uuid import uuid4

from prefect import get_run_logger, runtime
from prefect.artifacts import create_markdown_artifact

from opentinker.control.scheduler import CANCEL_REQUESTED_TAG, pool_for, prefect_client, seat_pool, slots_for
from opentinker.control.services import private_ray_dir
from opentinker.control.submit import check_ray_address
from opentinker.core.errors import one_line
from opentinker.core.ids import check_job_id
from opentinker.core.polling import through_blips
from opentinker.core.settings import Settings, get_settings, mlflow_env, ray_env, settings_env
from opentinker.orchestration.admission import admitted
from opentinker.orchestration.layout import Layout, layout_for
from opentinker.orchestration.task_runner import SettingsOnceRayTaskRunner, authenticate
from opentinker.storage.preflight import check_job_storage
from opentinker.tracking.runs import JobTracker, check_mlflow


# How long a job's own calls to Prefect wait out a control plane that does not answer (a restart).
CONTROL_BLIP_S = 180.0
# A crashed job's slots come free this long after its last lease renewal.
SLOT_LEASE_S = 60.0


class JobError(RuntimeError):
    """A job failed; the message is the one line users see (the cause is chained)."""


def ray_runner() -> SettingsOnceRayTaskRunner:
    """The job's Ray, chosen when its flow run starts (see `ray_connection`)."""
    return SettingsOnceRayTaskRunner(connect=ray_connection)


def cluster_address(settings: Settings) -> str | None:
    """The Ray cluster jobs join: the one the settings name, else the stack's head while it runs
    (a direct flow call next to a running stack joins it too); None: no cluster to join."""
    if settings.ray_address:
        return settings.ray_address
    if settings.ray_head:
        from opentinker.control.stack import Stack

        if Stack(settings).pid("ray") is not None:
            return settings.ray_head_address
    return None


def ray_connection() -> tuple[str | None, dict[str, Any]]:
    """(address, ray.init kwargs) for a flow run starting now.

    Joining a cluster: checked reachable first (one line instead of Ray's long retries), with the
    stack's token, and the job's code as a runtime environment (`job_runtime_env`). Each run gets a
    namespace of its own, so actor names of a crashed run never collide with its resubmission.
    Without a cluster: a local Ray for this run (sized to this machine, no dashboard), its folder in
    the state dir's private Ray home (not Ray's world-writable /tmp/ray)."""
    settings = get_settings()
    common = {"logging_level": "WARNING", "log_to_driver": False, "namespace": f"opentinker-{uuid4().hex[:12]}"}
    address = cluster_address(settings)
    if address:
        check_ray_address(address)
        authenticate(ray_env(settings))
        return address, {**common, "runtime_env": job_runtime_env(settings)}
    pythonpath = os.pathsep.join(p for p in (os.getcwd(), os.environ.get("PYTHONPATH")) if p)
    return None, {
        **common,
        "address": "local",  # never a cluster that `ray start` left on this machine
        "_temp_dir": str(private_ray_dir(settings.state_dir, "local")),
        "num_cpus": os.cpu_count() or 1,
        "include_dashboard": False,
        "object_store_memory": 512 * 1024**2,
        "runtime_env": {"env_vars": {"PYTHONPATH": pythonpath, "TOKENIZERS_PARALLELISM": "false"}},
        # Ray runs workers at nice 15 by default: the model actor then loses the CPU to every
        # server on the machine (measured: rollout and update ≈10% slower than in-process).
        "_system_config": {"worker_niceness": 0},
    }


# Settings of the driver's machine that mean nothing on another node.
_LOCAL_ONLY = ("OPENTINKER_BIND_HOST", "OPENTINKER_ADVERTISED_HOST", "OPENTINKER_GATEWAY_BIND_HOST", "OPENTINKER_STATE_DIR")


def job_runtime_env(settings: Settings) -> dict[str, Any]:
    """The job's code and settings travel with it to every node that runs its actors and tasks:
    the project's packages (opentinker, envs, flows, tasks) and the packages of the operator's
    game allowlist as `py_modules`, the settings (with the stack secret, which signs job tokens) as
    variables. So a Ray node needs only the base install (Python and the pinned libraries), not
    this checkout, and always runs the driver's version of the code."""
    import importlib
    import importlib.util

    names = ["opentinker", "envs", "flows", "tasks"]
    for prefix in settings.allowed_games:
        top = prefix.split(".")[0]
        if top not in names and importlib.util.find_spec(top) is not None:
            names.append(top)
    folders = [str(Path(importlib.import_module(name).__file__).parent) for name in names]
    env = {k: v for k, v in settings_env(settings).items() if k not in _LOCAL_ONLY}
    env |= mlflow_env(settings) | {"OPENTINKER_SECRET": settings.stack_secret(), "TOKENIZERS_PARALLELISM": "false"}
    return {"py_modules": folders, "excludes": ["__pycache__", "*.pyc"], "env_vars": env}


@contextmanager
def held_slots(num_gpus: float, tenant: str | None = None, seat: bool = False) -> Iterator[None]:
    """Hold the slots of `num_gpus` (one CPU slot for 0) in their pool's global concurrency limit
    (`seat`: one seat of the pool's base-model worker instead, for a session it hosts),
    and for a tenant's job first one slot of the tenant's running-jobs limit, taking turns with
    other tenants' jobs (the fair-share rule: opentinker/orchestration/admission.py). A job
    cancelled while it waits ends Cancelled here, without running anything.

    Only deployment runs take slots (the scheduler's runs); a direct call, as in a notebook or a
    benchmark, runs unscheduled. The leases are renewed while the run lives, through a Prefect
    server restart (`slot_lease`), and expire a minute after a crash; the flow-run tag tells
    clients the job left the queue.
    """
    if runtime.deployment.id is None:
        yield
        return
    pool = seat_pool(pool_for(num_gpus)) if seat else pool_for(num_gpus)
    with admitted(pool, 1 if seat else slots_for(num_gpus), tenant, lease_s=SLOT_LEASE_S, blip_s=CONTROL_BLIP_S,
                  log=get_run_logger()):
        try:
            yield
        except BaseException:  # SystemExit on the SIGTERM that stops a cancelled run
            _tag_if_cancelling()
            raise


def _tag_if_cancelling() -> None:
    """A run stopped while Cancelling (a cancel from the Prefect UI or API, not through the
    gateway) is tagged as the gateway's cancel tags it: Prefect records the killed process as
    Crashed, and `job_state` reads the run CANCELLED, as the user asked."""
    try:
        with prefect_client() as client:
            run = client.read_flow_run(runtime.flow_run.id)
            if run.state is not None and run.state.is_cancelling() and CANCEL_REQUESTED_TAG not in run.tags:
                client.update_flow_run(run.id, tags=[*run.tags, CANCEL_REQUESTED_TAG])
    except Exception:  # noqa: BLE001 - best effort while the process is being stopped
        get_run_logger().warning("could not tag the cancelled run", exc_info=True)


@dataclass(frozen=True)
class JobContext:
    job_id: str
    flow_run_id: str
    experiment: str
    tenant: str | None = None  # whose job: its checkpoints are signed as this tenant's (None: the operator's)
    layout: Layout | None = None  # where it runs (orchestration.layout), decided before its slots were taken

    def say_where(self, where: dict[str, str], tracker: JobTracker) -> None:
        """Where the job runs (its actors' `where` lines): one log line each, and the run's MLflow tags."""
        for line in where.values():
            get_run_logger().info(f"job {self.job_id}: {line}")
        tracker.set_tags(where)

    def on_restore(self, tracker: JobTracker) -> Callable[[Any], None]:
        """The step loop's `on_restore` hook (rl.loop): one warning per checkpoint folder the resume
        refused (also kept in the MLflow run's tag `opentinker.skipped_checkpoints`), then the
        steps the restored checkpoint covers that MLflow missed, logged."""
        logger = get_run_logger()

        def hook(restored: Any) -> None:
            for line in restored.skipped:
                logger.warning(f"resume skipped {line}")
            tracker.set_tags({"opentinker.skipped_checkpoints": "\n".join(restored.skipped)[:5000]})  # this resume's, "" for none
            if restored.resumed:
                logger.info(f"resuming at step {restored.step}; logged steps {tracker.log_missing_metrics(restored.metrics)} that MLflow missed")
            else:
                logger.warning(f"job {self.job_id}: no intact checkpoint, starting from step 0")
            if again := tracker.mark_abandoned(restored.step if restored.resumed else 0):
                logger.warning(f"steps {again} were trained before by an attempt whose checkpoint was not resumed: they are "
                               f"trained again, and MLflow's newest values at them are this attempt's (tag opentinker.abandoned_steps)")
        return hook

    @contextmanager
    def tracked(self, spec) -> Iterator[JobTracker]:
        """The job's MLflow run (found again on resume), linked from the Prefect flow run, ended
        FINISHED with the job or FAILED with it."""
        tracker = JobTracker(get_settings().mlflow_url, self.experiment, self.job_id, spec, tags={"prefect.flow_run_id": self.flow_run_id})
        through_blips(lambda: create_markdown_artifact(
            key=re.sub(r"[^a-z0-9-]", "-", f"mlflow-{self.job_id}".lower()),
            markdown=f"**OpenTinker job `{self.job_id}`**\n\nMLflow run: [{tracker.run_id}]({tracker.run_url})",
            description="MLflow run of this job",
        ), give_up_after_s=CONTROL_BLIP_S)
        try:
            yield tracker
        except BaseException:
            tracker.finish("FAILED")
            raise
        tracker.finish("FINISHED")


@contextmanager
def scheduled_job(spec, job_id: str | None, tenant: str | None) -> Iterator[JobContext]:
    """Fail fast on a missing MLflow server, unusable storage or an unplaceable job (where it runs is
    decided here, once: `JobContext.layout`), then hold the job's slots for the whole run; `tenant` names the MLflow experiment (the settings' project when
    None). A failure inside the job is logged in full and raised as one line (JobError). A job id
    that breaks the rule (core/ids.py; e.g. `../../x` from a flow run made past the gateway and the
    CLI) is refused first, before anything is written: InvalidJobId."""
    flow_run_id = str(runtime.flow_run.id or "local")
    job_id = check_job_id(job_id or spec.job_id or f"job-{flow_run_id[:8]}", "job_id")
    settings = get_settings()
    check_mlflow(settings.mlflow_url)
    check_job_storage(spec)
    layout = layout_for(spec, job_id, tenant, on_cluster=cluster_address(settings) is not None)
    with held_slots(spec.resources.num_gpus, tenant, seat=layout.seat):
        context = JobContext(job_id, flow_run_id, tenant or settings.project, tenant, layout)
        try:
            yield context
        except Exception as err:
            get_run_logger().error(f"job {context.job_id} failed", exc_info=True)  # with a Ray worker's traceback, if any
            raise JobError(f"job {context.job_id}: {lost_cluster_line(err, spec, context.job_id, tenant) or one_line(err)}") from err


# Ray's errors for work that vanished with a process or a node (not the job's own fault).
_LOST = {"RayActorError", "ActorDiedError", "ActorUnavailableError", "NodeDiedError", "ObjectLostError", "OwnerDiedError", "RankLost"}


def lost_cluster_line(err: BaseException, spec: Any, job_id: str, tenant: str | None = None) -> str | None:
    """For a job whose actors or node went away (a node killed, the head dead, the base-model worker
    of a job that shares its base): what happened and where a resubmission resumes, instead of
    Ray's paragraph about node ids; None for other errors."""
    if not _LOST & {cls.__name__ for cls in type(err).__mro__}:
        return None
    if getattr(err, "actor_init_failed", False):  # its __init__ raised (a bad game, say): the job's own error
        return None
    from opentinker.storage.checkpoint import Owner, latest_checkpoint

    try:
        latest = latest_checkpoint(spec.checkpoint.base_url, job_id, Owner(job_id, tenant))
        resume = f"from step {latest.step} ({latest.url})" if latest else "from the start (no checkpoint yet)"
    except Exception:  # noqa: BLE001 - the storage may be what failed; the line still says what to do
        resume = "from its last complete checkpoint"
    return f"{type(err).__name__}: {_what_was_lost(err, spec)}; resubmit job {job_id} to resume {resume}"


def _node_address(text: str) -> str:
    """` (10.0.0.2)`: the address of the node Ray's error names by id, while the cluster still lists it."""
    found = re.search(r"Node Id: ([0-9a-f]+)", text)
    try:
        import ray

        nodes = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()} if found and ray.is_initialized() else {}
    except Exception:  # noqa: BLE001 - the head may be what went away; the line stands without it
        nodes = {}
    return f" ({nodes[found.group(1)]})" if found and found.group(1) in nodes else ""


def _what_was_lost(err: BaseException, spec: Any) -> str:
    """Which of the job's actors died and how, from Ray's error (its text names the actor's class and,
    when its node died, says so): a killed actor is not a node that left."""
    if getattr(spec.resources, "share_base", False):
        return "the base-model worker hosting it died (killed, out of memory, or its Ray node went away)"
    if type(err).__name__ == "RankLost":  # which rank of a sharded trainer, and where (opentinker.orchestration.ranks)
        return str(err)
    text = str(err)
    found = re.search(r"class_name: (\S+)", text)
    actor = f"the job's {found.group(1).rsplit('.', 1)[-1]} actor" if found else "an actor of the job"
    if type(err).__name__ == "NodeDiedError" or "node has died" in text:
        return f"the Ray node running {actor}{_node_address(text)} left the cluster (killed, or the head went away)"
    if type(err).__name__ == "ActorUnavailableError":  # Ray cannot reach it: it, its node or the network went away
        return f"{actor} became unreachable (its process, its Ray node or the network to it went away)"
    if found is None and type(err).__name__ in ("ObjectLostError", "OwnerDiedError"):
        return "the Ray node running its actors left the cluster (killed, or the head went away)"
    return f"{actor} died (its process was killed or ran out of memory; its Ray node is still up)"


def register_final_checkpoint(job: JobContext, tenant: str | None, url: str, tracker: JobTracker, *, kind: str,
                              spec_data: dict[str, Any], model_name: str, base_model: str,
                              environment: str | None, agent: str | None = None,
                              eval_env: dict[str, Any] | None = None) -> dict[str, Any]:
    """Register a completed job's checkpoint (opentinker/storage/registry.py) and tag its MLflow
    run (`opentinker.registered_model`, or `…_model.<agent>` for one agent of a self-play job,
    whose exported model the run holds under `final-<agent>`).

    A registry failure fails the job rather than warning: registration is part of a completed
    job's contract (the evaluation trigger and `models:/…@champion` rely on it), and a COMPLETED
    job missing from the registry would go unnoticed. The checkpoint is committed before this runs,
    so nothing trained is lost: re-running the job id resumes at its last step and only registers."""
    from opentinker.storage.registry import RegistryError, register_job_checkpoint

    try:
        reg = register_job_checkpoint(
            checkpoint_url=url, model_name=model_name, job_id=job.job_id, kind=kind, spec_data=spec_data,
            base_model=base_model, environment=environment,
            flow_run_id=job.flow_run_id if job.flow_run_id != "local" else None, mlflow_run_id=tracker.run_id,
            tracking_uri=tracker.tracking_uri, eval_env=eval_env, artifact_folder=f"final-{agent}" if agent else "final",
            tenant=tenant)
    except (RegistryError, ValueError) as err:
        raise RegistryError(f"job {job.job_id}: training finished and checkpoint {url} is saved, but {err}; "
                            "re-running the same job id registers it without training again") from err
    suffix = f".{agent}" if agent else ""
    tracker.set_tags({f"opentinker.registered_model{suffix}": reg["name"], f"opentinker.registered_version{suffix}": reg["version"]})
    return reg
