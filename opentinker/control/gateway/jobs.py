"""A tenant's view of jobs: Prefect flow runs tagged with the tenant, and their MLflow runs.

Every lookup filters on the tenant's tag, so a job of another tenant is indistinguishable from
a job that does not exist. Specs (RL, self-play or SFT) are validated here, before anything
reaches Prefect, and everything they name is confined to the tenant (see confine.py). A tenant
may have `tenant_max_queued` jobs waiting (one more is refused, 429; counted and created under the
tenant's lock, so a burst admits exactly that many: quota.py) and `tenant_max_running` running (the
rest wait their turn in the queue: the flow holds a slot of `tenant-<name>`). A tenant's runs go to
its own work queue of the pool, and waiting jobs of several tenants take turns for the slots (the
fair-share rule: opentinker/orchestration/admission.py).

`StackJobs` is the operator's view of the same jobs on the stack's machine (every tenant's and the
operator's own, no key: `opentinker jobs` without OPENTINKER_API_KEY); it answers with the same
fields, and never sits behind the gateway.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timedelta, timezone
from typing import Any

from opentinker.control.gateway import checkpoints, confine, inference
from opentinker.control.follow import LOG_SETTLE_S, Progress, flow_run_logs, mlflow_runs, read_progress
from opentinker.control.gateway.quota import tenant_lock
from opentinker.control.gateway.tenant_logs import tenant_lines
from opentinker.control.scheduler import (AWAITING_ENV, CANCEL_REQUESTED_TAG, QUEUED_CANCEL, SLOTS_HELD_TAG, check_fits, deployment_name,
                                          ensure_tenant_limit, ensure_tenant_queue, flow_for, job_state, job_tags, parked_state,
                                          prefect_client)
from opentinker.core.settings import Settings
from opentinker.core.spec import MultiAgentSpec, SpecError, parse_spec
from opentinker.core.spec_limits import input_problem
from opentinker.core.states import TERMINAL
from opentinker.core.tokens import job_token
from opentinker.sft.spec import is_sft_spec, parse_sft_spec
from opentinker.storage.registry import model_name_for

# Stands in for the environment while a job waits for fit(): the rest of the spec is checked now.
_PLACEHOLDER_ENV = {"link": "pending"}


class JobNotFound(LookupError):
    pass


class JobConflict(RuntimeError):
    pass


class CheckpointNotFound(LookupError):
    """No folder of that step in one of the tenant's own jobs (HTTP 404); the message says so."""


class TooManyJobs(RuntimeError):
    """A tenant over its limit of waiting jobs (HTTP 429); the message has the numbers."""


class TenantJobs:
    def __init__(self, settings: Settings, tenant: str):
        self.settings = settings
        self.tenant = tenant

    # --- Prefect --------------------------------------------------------------------------
    def _tags(self, job_id: str | None = None) -> list[str]:
        """The tags every run this view sees carries: the tenant's (and the job's)."""
        return [f"tenant:{self.tenant}"] + ([f"job:{job_id}"] if job_id else [])

    def _experiment(self, run: Any) -> str:
        """The MLflow experiment of a run's job: the tenant's own."""
        return self.tenant

    def _runs(self, job_id: str | None = None) -> list[Any]:
        """The view's runs (of one job), newest first; of many, the 200 scheduled last (Prefect's
        default order is by random id), parked ones first."""
        from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterTags
        from prefect.client.schemas.sorting import FlowRunSort

        tags = self._tags(job_id)
        with prefect_client() as client:
            runs = client.read_flow_runs(flow_run_filter=FlowRunFilter(tags=FlowRunFilterTags(all_=tags)), limit=200,
                                         sort=FlowRunSort.EXPECTED_START_TIME_DESC)
        return sorted(runs, key=lambda r: r.created or datetime.min.replace(tzinfo=timezone.utc), reverse=True)

    def _run(self, job_id: str) -> Any:
        runs = self._runs(job_id)
        if not runs:
            raise JobNotFound(job_id)
        return runs[0]  # a re-submitted job id resumes in a newer run

    def owns(self, job_id: str) -> bool:
        return bool(self._runs(job_id))

    # --- submit ---------------------------------------------------------------------------
    def _normalise(self, config: dict[str, Any], num_gpus: float | None) -> tuple[Any, bool]:
        """(validated spec in the tenant's namespace, whether the environment is still missing)."""
        if problem := input_problem(config):  # before anything below touches a file name or a module
            raise SpecError(problem)
        data = dict(config)
        sft = is_sft_spec(data)
        env = dict(data.get("env") or {})
        awaiting_env = not sft and not any(env.get(k) for k in ("game", "url", "link", "source"))  # fit() will say where the game is
        if num_gpus is not None:
            data["resources"] = {**dict(data.get("resources") or {}), "num_gpus": num_gpus}
        name = str(data.get("job_id") or uuid.uuid4().hex[:8])
        data["job_id"] = name if name.startswith(f"{self.tenant}-") else f"{self.tenant}-{name}"
        data = confine.confine_common(self.settings, self.tenant, data)
        if sft:
            data_section = dict(data.get("data") or {})
            if "path" in data_section:
                data_section["path"] = confine.tenant_location(self.storage_url, str(data_section["path"]), "data.path")
            data["data"] = data_section
            spec = parse_sft_spec(data)
            confine.registry_name(self.settings, self.tenant, model_name_for(
                {"registry": {"model_name": spec.registry.model_name or f"{self.tenant}-sft"}}, self.tenant, self.tenant))
            return spec, False
        players = data["multiagent"].get("players", MultiAgentSpec.model_fields["players"].default_factory()) \
            if isinstance(data.get("multiagent"), dict) else None
        players = players if isinstance(players, list) and all(isinstance(p, str) for p in players) else None  # else parse_spec says why
        data["env"] = {**env, **_PLACEHOLDER_ENV} if awaiting_env else confine.confine_env(self.settings, self.tenant, env, players)
        confine.confine_rollout(data)
        spec = parse_spec(data)
        if spec.registry.model_name:  # the default name (<tenant>-<game>) is the tenant's own by construction
            confine.registry_name(self.settings, self.tenant, model_name_for(spec.model_dump(mode="json"), self.tenant, self.tenant))
        return spec, awaiting_env

    @property
    def storage_url(self) -> str:
        return confine.tenant_storage(self.settings, self.tenant)

    def latest_runs(self) -> dict[str, Any]:
        """{job id: its newest flow run} of the tenant (a resubmitted job's latest run counts)."""
        latest: dict[str, Any] = {}
        for run in self._runs():  # newest first
            job_id = next((t.split(":", 1)[1] for t in run.tags if t.startswith("job:")), None)
            if job_id and job_id not in latest:
                latest[job_id] = run
        return latest

    def queued(self) -> int:
        """How many of the tenant's flow runs wait now (QUEUED), among those that have not ended."""
        from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterState, FlowRunFilterStateType, FlowRunFilterTags
        from prefect.client.schemas.objects import StateType

        live = FlowRunFilter(tags=FlowRunFilterTags(all_=[f"tenant:{self.tenant}"]), state=FlowRunFilterState(
            type=FlowRunFilterStateType(any_=[StateType.SCHEDULED, StateType.PENDING, StateType.PAUSED, StateType.RUNNING])))
        count, offset, page = 0, 0, 200
        with prefect_client() as client:
            while True:
                runs = client.read_flow_runs(flow_run_filter=live, limit=page, offset=offset)
                count += sum(job_state(run)[0] == "QUEUED" for run in runs)
                if len(runs) < page:
                    return count
                offset += page

    def check_limits(self) -> None:
        """TooManyJobs when the tenant already has its limit of waiting jobs."""
        queued = self.queued()
        if queued >= self.settings.tenant_max_queued:
            raise TooManyJobs(f"tenant {self.tenant} has {queued} jobs waiting, the limit is {self.settings.tenant_max_queued}: "
                              "wait for some to start or cancel them")

    @contextmanager
    def admission(self) -> Iterator[None]:
        """The block creates one more waiting job of the tenant: TooManyJobs at its limit, counted
        under the tenant's lock (quota.py) so that concurrent submissions cannot all pass."""
        self.check_limits()  # a burst over the limit is refused without waiting for the lock
        with tenant_lock(self.settings, self.tenant):
            self.check_limits()
            yield

    def submit(self, config: dict[str, Any], num_gpus: float | None = None) -> dict[str, Any]:
        spec, awaiting_env = self._normalise(config, num_gpus)
        pool = check_fits(self.settings, spec.resources.num_gpus)
        ensure_tenant_limit(self.tenant, self.settings.tenant_max_running)
        queue = ensure_tenant_queue(self.settings, self.tenant, pool)
        params = spec.model_dump(mode="json")
        if awaiting_env:  # kept: its limits; fit() gives the game and its config
            params["env"] = {k: v for k, v in params["env"].items() if k not in ("game", "url", "link", "config")}
        with self.admission(), prefect_client() as client:
            deployment = client.read_deployment_by_name(deployment_name(flow_for(params), pool))
            run = client.create_flow_run_from_deployment(
                deployment.id, parameters={"spec": params, "job_id": spec.job_id, "tenant": self.tenant},
                tags=job_tags(self.tenant, spec.job_id), state=parked_state() if awaiting_env else None, work_queue_name=queue,
            )
        return self.describe(spec.job_id, run)

    def start(self, job_id: str, env: dict[str, Any], steps: int | None = None) -> dict[str, Any]:
        """Complete a parked job's spec with its environment (and step count) and queue it."""
        from prefect.states import Scheduled

        if problem := input_problem({"env": env}):  # before a name or a module in it is looked up
            raise SpecError(problem)
        with tenant_lock(self.settings, self.tenant):  # of racing fit()s one starts the job; the rest: 409, nothing written
            run = self._run(job_id)
            if not (run.state and run.state.name == AWAITING_ENV):
                raise JobConflict(f"job {job_id} is not waiting for its environment (state {job_state(run)[0]})")
            params = dict(run.parameters["spec"])
            params["env"] = confine.confine_env(self.settings, self.tenant, {**(params.get("env") or {}), **env})
            if steps is not None:
                params["optimization"] = {**params.get("optimization", {}), "steps": steps}
            spec = parse_spec(params)
            with prefect_client() as client:
                client.update_flow_run(run.id, parameters={**run.parameters, "spec": spec.model_dump(mode="json")})
                client.set_flow_run_state(run.id, Scheduled(), force=True)
        return self.status(job_id)

    # --- read -----------------------------------------------------------------------------
    def describe(self, job_id: str, run: Any) -> dict[str, Any]:
        """What Prefect knows of a job (no MLflow: submit answers with it at once)."""
        state, reason = job_state(run)
        spec = run.parameters.get("spec") or {}
        out = {
            "job_id": job_id, "tenant": run.parameters.get("tenant"), "state": state, "reason": reason,
            "num_gpus": (spec.get("resources") or {}).get("num_gpus", 0),
            "total_steps": (spec.get("optimization") or {}).get("steps"),
            "created": _iso(run.created), "started": _iso(run.start_time), "ended": _iso(run.end_time),
            "server_url": f"{self.settings.public_gateway_url}/v1/jobs/{job_id}",
            "job_token": job_token(self.settings.stack_secret(), job_id),  # for the servers this job talks to
            "links": {"prefect": f"{self.settings.prefect_ui_url}/runs/flow-run/{run.id}"},
        }
        if inference.KIND_TAG in (run.tags or []):
            out |= inference.endpoint(self, job_id, run)  # its URL while it serves
        return out

    def _with_progress(self, out: dict[str, Any], progress: Progress) -> dict[str, Any]:
        """A job's description with its MLflow progress: step, last reward and accuracy, failures."""
        out |= {"step": progress.step, "reward": progress.reward, "accuracy": progress.accuracy}
        if progress.total is not None:  # an SFT job: the steps its data and epochs make
            out["total_steps"] = progress.total
        if progress.failure:
            out["failure"] = progress.failure  # the newest step's most common one
        if progress.mlflow_run_url:
            out["links"]["mlflow"] = progress.mlflow_run_url
        return out

    def list(self) -> list[dict[str, Any]]:
        """Every job of the view, newest first, with its progress (one MLflow search per experiment)."""
        from mlflow.tracking import MlflowClient

        latest = self.latest_runs()
        ml = MlflowClient(tracking_uri=self.settings.mlflow_url)
        found = {name: mlflow_runs(ml, name) for name in {self._experiment(run) for run in latest.values()}}
        out = []
        for job_id, run in latest.items():
            experiment, ml_runs = found[self._experiment(run)]
            progress = Progress(state="")
            if job_id in ml_runs:
                read_progress(ml, experiment, ml_runs[job_id], self.settings, progress, eval_step=False)
            out.append(self._with_progress(self.describe(job_id, run), progress))
        return out

    def status(self, job_id: str) -> dict[str, Any]:
        run = self._run(job_id)
        out = self.describe(job_id, run) | {"metrics": {}, "checkpoint": None, "skipped_checkpoints": []}
        progress = Progress(state="")
        if (ml := self._mlflow_run(job_id, run)) is not None:
            client, experiment, ml_run = ml
            read_progress(client, experiment, ml_run, self.settings, progress)
            out["metrics"] = dict(ml_run.data.metrics)
            out["checkpoint"] = progress.result.get("checkpoint")
            out["skipped_checkpoints"] = [line for line in ml_run.data.tags.get("opentinker.skipped_checkpoints", "").split("\n") if line]
        return self._with_progress(out, progress) | {"accuracy_step": progress.accuracy_step}

    def logs(self, job_id: str, offset: int = 0, limit: int = 200) -> dict[str, Any]:
        """A page of the job's log lines (its newest flow run's, oldest first) from `offset`, and
        its state as read before them. `complete`: the job has ended long enough ago that every
        line is in; a follower stops at the first short page that says so."""
        run = self._run(job_id)
        state, reason = job_state(run)
        settled = datetime.now(timezone.utc) - timedelta(seconds=2 * LOG_SETTLE_S)  # its worker's last lines come after its end
        complete = state in TERMINAL and (run.end_time is None or run.end_time < settled)
        lines = self._shown(flow_run_logs(run.id, offset, limit))
        return {"job_id": job_id, "state": state, "reason": reason, "complete": complete, "offset": offset,
                "next_offset": offset + len(lines), "lines": lines}

    def _shown(self, lines: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """A tenant reads its job's lines without tracebacks and the operator's paths (tenant_logs.py)."""
        return tenant_lines(lines, self.settings)

    def cancel(self, job_id: str) -> dict[str, Any]:
        """A job that holds no slots yet (scheduled, parked, pending, or started and waiting for
        its slots) is CANCELLED at once, on the first cancel: tagged, then set Cancelled; a process
        that exists or starts for it later sees the tag before it takes anything and ends without
        running (opentinker/orchestration/admission.py). A running job goes through CANCELLING
        (the worker stops the process, the slots' lease is released)."""
        from prefect.states import Cancelled, Cancelling

        run = self._run(job_id)
        state, _ = job_state(run)
        if state in ("COMPLETED", "FAILED", "CANCELLED"):
            raise JobConflict(f"job {job_id} already ended ({state})")
        with prefect_client() as client:
            run = client.read_flow_run(run.id)  # its tags as they are now
            tags = run.tags or []
            if CANCEL_REQUESTED_TAG not in tags:  # first: the sign every process of the job looks for
                client.update_flow_run(run.id, tags=[*tags, CANCEL_REQUESTED_TAG])
            running = SLOTS_HELD_TAG in tags or (run.state is not None and run.state.is_cancelling())
            client.set_flow_run_state(run.id, Cancelling() if running else Cancelled(message=QUEUED_CANCEL), force=True)
        return self.status(job_id)

    # --- checkpoints (see checkpoints.py) ------------------------------------------------------
    def list_checkpoints(self, job_id: str) -> list[dict[str, Any]]:
        spec = self._run(job_id).parameters.get("spec") or {}
        return checkpoints.listed(self.storage_url, self.tenant, job_id, spec, self.settings.stack_secret())

    def delete_checkpoint(self, job_id: str, step: int) -> dict[str, Any]:
        spec = self._run(job_id).parameters.get("spec") or {}
        deleted = checkpoints.delete(self.storage_url, job_id, spec, step)
        if not deleted:
            raise CheckpointNotFound(f"job {job_id} has no checkpoint folder of step {step}")
        return {"job_id": job_id, "step": step, "deleted": deleted}

    # --- MLflow ---------------------------------------------------------------------------
    def _mlflow_run(self, job_id: str, run: Any):
        """(client, experiment, the job's newest MLflow run), or None before it has one."""
        from mlflow.tracking import MlflowClient

        client = MlflowClient(tracking_uri=self.settings.mlflow_url)
        experiment, runs = mlflow_runs(client, self._experiment(run), job_id)
        return (client, experiment, runs[job_id]) if job_id in runs else None

    def metrics(self, job_id: str) -> dict[str, list[list[float]]]:
        ml = self._mlflow_run(job_id, self._run(job_id))
        if ml is None:
            return {}
        client, _, run = ml
        return {key: [[m.step, m.value] for m in sorted(client.get_metric_history(run.info.run_id, key), key=lambda m: m.step)]
                for key in run.data.metrics}

    def artifacts(self, job_id: str, path: str | None = None) -> list[dict[str, Any]]:
        ml = self._mlflow_run(job_id, self._run(job_id))
        if ml is None:
            return []
        client, _, run = ml
        return [{"path": f.path, "is_dir": f.is_dir, "size": f.file_size} for f in client.list_artifacts(run.info.run_id, path)]

    def download_artifact(self, job_id: str, path: str, dst: str) -> str:
        ml = self._mlflow_run(job_id, self._run(job_id))
        if ml is None:
            raise JobNotFound(f"{job_id}: no artifacts yet")
        client, _, run = ml
        return client.download_artifacts(run.info.run_id, path, dst)


class StackJobs(TenantJobs):
    """The operator's view on the stack's machine: every job (each tenant's, and those `opentinker
    train` submitted without one), read and cancelled as a tenant's are. Not for the gateway."""

    def __init__(self, settings: Settings):
        self.settings = settings
        self.tenant = None

    def _tags(self, job_id: str | None = None) -> list[str]:
        return ["opentinker"] + ([f"job:{job_id}"] if job_id else [])

    def _experiment(self, run: Any) -> str:
        return run.parameters.get("tenant") or self.settings.project

    def _shown(self, lines: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return lines  # the operator's own machine: whole, tracebacks and paths too

    def list_checkpoints(self, job_id: str) -> list[dict[str, Any]]:
        """The job's step folders where its spec put them (a tenant's job: the tenant's storage)."""
        run = self._run(job_id)
        spec = run.parameters.get("spec") or {}
        root = (spec.get("checkpoint") or {}).get("base_url") or self.settings.storage_url
        return checkpoints.listed(root, run.parameters.get("tenant"), job_id, spec, self.settings.stack_secret())


def _iso(when: Any) -> str | None:
    return when.isoformat() if when else None


def spec_error_lines(err: SpecError) -> list[str]:
    return [line.strip() for line in str(err).splitlines() if line.strip()]
