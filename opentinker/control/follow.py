"""Following a job from the operator's side: one look at its Prefect state and its newest MLflow
metrics (`poll`), looks until it ends (`follow`), and finding a job's run again by its id
(`latest_flow_run`, for `opentinker follow <job>`).

A follower outlives the control plane's blips: a look that finds Prefect or MLflow down is
tried again with backoff (`on_retry` says so), and only after `give_up_after_s` without an answer
does `follow` stop, with FollowLost saying how to re-attach; the job itself goes on.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from opentinker.core.polling import through_blips, wait_for
from opentinker.core.settings import Settings
from opentinker.core.states import TERMINAL
from opentinker.tracking.metrics import headline_key
from opentinker.tracking.runs import JOB_TAG


class FollowLost(RuntimeError):
    """The control plane did not answer for too long; the job may still run (re-attach later)."""


@dataclass
class Progress:
    state: str
    step: int = 0
    reward: float | None = None
    accuracy: float | None = None
    accuracy_step: int | None = None
    failed: int = 0  # failed episodes of the newest step
    failure: str | None = None  # the newest step's most common failure, e.g. "reset: RuntimeError: … (8 of 8 episodes)"
    eval_failed: int = 0
    mlflow_run_id: str | None = None
    mlflow_run_url: str | None = None
    message: str | None = None
    result: dict[str, Any] = field(default_factory=dict)


def _latest(client, run_id: str, key: str) -> tuple[int, float] | None:
    history = client.get_metric_history(run_id, key)
    if not history:
        return None
    last = max(history, key=lambda m: (m.step, m.timestamp))
    return last.step, last.value


def latest_flow_run(job_id: str) -> Any:
    """The newest flow run of a job (a re-submitted id resumes in a newer run); LookupError if none."""
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterTags
    from prefect.client.schemas.sorting import FlowRunSort

    from opentinker.control.scheduler import prefect_client

    with prefect_client() as client:
        runs = client.read_flow_runs(flow_run_filter=FlowRunFilter(tags=FlowRunFilterTags(all_=[f"job:{job_id}"])),
                                     sort=FlowRunSort.START_TIME_DESC, limit=1)
    if not runs:
        raise LookupError(f"no job {job_id!r} on this stack")
    return runs[0]


def poll(flow_run_id: str, job_id: str, settings: Settings, experiment: str | None = None) -> Progress:
    """One look at a job: its Prefect state and its newest MLflow metrics."""
    from mlflow.tracking import MlflowClient

    from opentinker.control.scheduler import job_state, prefect_client

    with prefect_client() as client:
        run = client.read_flow_run(flow_run_id)
    state, reason = job_state(run)
    progress = Progress(state=state, message=reason)
    ml = MlflowClient(tracking_uri=settings.mlflow_url)
    found = ml.get_experiment_by_name(experiment or run.parameters.get("tenant") or settings.project)
    if found is None:
        return progress
    runs = ml.search_runs([found.experiment_id], filter_string=f"tags.`{JOB_TAG}` = '{job_id}'", max_results=1)
    if not runs:
        return progress
    ml_run = runs[0]
    progress.mlflow_run_id = ml_run.info.run_id
    progress.mlflow_run_url = f"{settings.mlflow_url}/#/experiments/{found.experiment_id}/runs/{ml_run.info.run_id}"
    keys = ml_run.data.metrics
    if reward := _latest(ml, ml_run.info.run_id, headline_key(keys, "rollout/reward_mean")):
        progress.step, progress.reward = reward
    if acc := _latest(ml, ml_run.info.run_id, headline_key(keys, "eval/accuracy")):
        progress.accuracy_step, progress.accuracy = acc
    progress.failed = int(keys.get(headline_key(keys, "rollout/failed_episodes"), 0))
    progress.eval_failed = int(keys.get(headline_key(keys, "eval/failed_episodes"), 0))
    tags = ml_run.data.tags
    if progress.failed:
        progress.failure = tags.get("opentinker.rollout/first_failure")
    progress.result = {"checkpoint": tags.get("opentinker.checkpoint")}
    if per_agent := {k.rpartition(".")[2]: v for k, v in tags.items() if k.startswith("opentinker.checkpoint.")}:
        progress.result["checkpoints"] = per_agent  # a self-play job: one final checkpoint per learning agent
    return progress


def follow(flow_run_id: str, job_id: str, settings: Settings, on_update: Callable[[Progress], None], interval: float = 2.0,
           on_retry: Callable[[int, BaseException], None] | None = None, give_up_after_s: float = 900.0) -> Progress:
    """Look until the job ends, calling `on_update` after every look; FollowLost after
    `give_up_after_s` without an answer from the control plane."""

    def look() -> Progress | None:
        try:
            progress = through_blips(lambda: poll(flow_run_id, job_id, settings), give_up_after_s=give_up_after_s, on_retry=on_retry)
        except Exception as err:
            from opentinker.core.polling import is_blip

            if is_blip(err):
                raise FollowLost(f"no answer from the control plane for {give_up_after_s:g}s ({type(err).__name__}); job {job_id} "
                                 f"may still be running: re-attach with `opentinker follow {job_id}`") from None
            raise
        on_update(progress)
        return progress if progress.state in TERMINAL else None

    return wait_for(look, interval=interval, what=f"job {job_id} to end")
