"""Following a job from the operator's side: one look at its Prefect state and its newest MLflow
metrics (`poll`), looks until it ends (`follow`), and finding a job's run again by its id
(`latest_flow_run`, for `opentinker follow <job>`). The gateway reads a job's progress and logs
with the same helpers (`mlflow_runs`, `read_progress`, `flow_run_logs`), so a tenant and the
operator see the same numbers.

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
    total: int | None = None  # an SFT job's optimizer steps (its spec does not say them; the job logs them)
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


def mlflow_runs(ml, experiment: str, job_id: str | None = None) -> tuple[Any, dict[str, Any]]:
    """(the MLflow experiment or None, {job id: its newest run}): one job's, or with no `job_id`
    every job's in the experiment, in one search."""
    found = ml.get_experiment_by_name(experiment)
    if found is None:
        return None, {}
    runs = ml.search_runs([found.experiment_id], filter_string=f"tags.`{JOB_TAG}` = '{job_id}'" if job_id else "",
                          order_by=["attributes.start_time DESC"], max_results=1 if job_id else 1000)
    newest: dict[str, Any] = {}
    for run in runs:
        if (job := run.data.tags.get(JOB_TAG)) and job not in newest:
            newest[job] = run
    return found, newest


def read_progress(ml, experiment: Any, ml_run: Any, settings: Settings, progress: Progress, eval_step: bool = True) -> Progress:
    """Fill `progress` from a job's MLflow run: its step and reward (an SFT job's step and total),
    validation accuracy (with the step it was measured at unless not `eval_step`: one call less),
    failing episodes, the run's link and the final checkpoint(s)."""
    run_id, keys, tags = ml_run.info.run_id, ml_run.data.metrics, ml_run.data.tags
    progress.mlflow_run_id = run_id
    progress.mlflow_run_url = f"{settings.mlflow_url}/#/experiments/{experiment.experiment_id}/runs/{run_id}"
    reward_key = headline_key(keys, "rollout/reward_mean")
    if reward_key in keys and (reward := _latest(ml, run_id, reward_key)):
        progress.step, progress.reward = reward
    elif "sft/loss" in keys and (loss := _latest(ml, run_id, "sft/loss")):
        progress.step, progress.total = loss[0], int(keys.get("sft/max_steps", 0)) or None
    if (acc_key := headline_key(keys, "eval/accuracy")) in keys:
        progress.accuracy = keys[acc_key]
        if eval_step and (acc := _latest(ml, run_id, acc_key)):
            progress.accuracy_step, progress.accuracy = acc
    progress.failed = int(keys.get(headline_key(keys, "rollout/failed_episodes"), 0))
    progress.eval_failed = int(keys.get(headline_key(keys, "eval/failed_episodes"), 0))
    if progress.failed:
        progress.failure = tags.get("opentinker.rollout/first_failure")
    if keys.get(headline_key(keys, "rollout/truncated_episodes")):  # the newest step's, shown like a failure
        cut = tags.get("opentinker.rollout/first_truncation")
        progress.failure = "; ".join(filter(None, [progress.failure, cut])) or None
    progress.result = {"checkpoint": tags.get("opentinker.checkpoint")}
    if per_agent := {k.rpartition(".")[2]: v for k, v in tags.items() if k.startswith("opentinker.checkpoint.")}:
        progress.result["checkpoints"] = per_agent  # a self-play job: one final checkpoint per learning agent
    return progress


def poll(flow_run_id: str, job_id: str, settings: Settings, experiment: str | None = None) -> Progress:
    """One look at a job: its Prefect state and its newest MLflow metrics."""
    from mlflow.tracking import MlflowClient

    from opentinker.control.scheduler import job_state, prefect_client

    with prefect_client() as client:
        run = client.read_flow_run(flow_run_id)
    state, reason = job_state(run)
    progress = Progress(state=state, message=reason)
    ml = MlflowClient(tracking_uri=settings.mlflow_url)
    found, runs = mlflow_runs(ml, experiment or run.parameters.get("tenant") or settings.project, job_id)
    return read_progress(ml, found, runs[job_id], settings, progress) if job_id in runs else progress


LOG_SETTLE_S = 5.0
"""How old a log line is before it is shown. Each process of a job (the flow, its Ray workers,
the Prefect worker) sends its lines every 2 s, so a line can arrive after later ones: lines
younger than this may still be joined by older ones and are left for the next read, so that an
offset into the lines read so far stays valid (a follower misses nothing and repeats nothing)."""


def flow_run_logs(flow_run_id: Any, offset: int = 0, limit: int = 200) -> list[dict[str, Any]]:
    """A flow run's settled log lines, oldest first, from the `offset`-th: time, level, message and
    the task run that wrote it (None: the flow or its worker). Prefect pages by offset, as `prefect
    flow-run logs` does, and answers at most 200 lines at a time."""
    import logging
    from datetime import datetime, timedelta, timezone

    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId, LogFilterTimestamp, TaskRunFilter, TaskRunFilterId
    from prefect.client.schemas.sorting import LogSort

    from opentinker.control.scheduler import prefect_client

    settled = LogFilterTimestamp(before_=datetime.now(timezone.utc) - timedelta(seconds=LOG_SETTLE_S))
    with prefect_client() as client:
        logs = client.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id]), timestamp=settled), limit=limit,
                                offset=offset, sort=LogSort.TIMESTAMP_ASC)
        task_ids = list({log.task_run_id for log in logs if log.task_run_id})
        tasks = {t.id: t.name for t in client.read_task_runs(task_run_filter=TaskRunFilter(id=TaskRunFilterId(any_=task_ids)),
                                                             limit=len(task_ids))} if task_ids else {}
    return [{"time": log.timestamp.isoformat(), "level": logging.getLevelName(log.level), "message": log.message,
             "task": tasks.get(log.task_run_id)} for log in logs]


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
