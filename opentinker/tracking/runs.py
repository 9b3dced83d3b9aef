"""The one MLflow writer: every run the project records (a job's run, an evaluation's audit run,
an inference run, a registration anchor) is written through `Run`.

A job's run (`JobTracker`) is found again by its job id on resume; its params are the flattened
spec, its metrics the per-step ones, its artifacts transcripts and the final adapter. Experiments
are created as "custom model development" experiments, so MLflow's UI opens their runs in the
model-training view (not the GenAI evaluation view).
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path
from typing import Any

from opentinker.core.spec import dump_spec
from opentinker.tracking.transcripts import transcripts_html

JOB_TAG = "opentinker.job_id"
ABANDONED_TAG = "opentinker.abandoned_steps"  # steps a resumed job trained again (see JobTracker.mark_abandoned)
STEP_KEY = "step/seconds"  # a metric every trained step logs
EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
TRAINING_KIND = "custom_model_development"


def check_mlflow(url: str, timeout: float = 5.0) -> None:
    """Fail in one line when the MLflow server is down (its client would retry for minutes)."""
    import httpx

    try:
        httpx.get(f"{url}/health", timeout=timeout).raise_for_status()
    except httpx.HTTPError as err:
        raise ConnectionError(f"MLflow server at {url} is not reachable ({type(err).__name__}); start the stack with `opentinker up`") from None


def mlflow_client(tracking_uri: str | None = None, registry: bool = False):
    """An MlflowClient for `tracking_uri` (default: the stack's server), after a health check of an
    http server; `registry` also points its model registry there."""
    from mlflow.tracking import MlflowClient

    from opentinker.core.settings import get_settings

    uri = tracking_uri or get_settings().mlflow_url
    if uri.startswith("http"):
        check_mlflow(uri)
    return MlflowClient(tracking_uri=uri, registry_uri=uri) if registry else MlflowClient(tracking_uri=uri)


def experiment_id(client, name: str) -> str:
    """The id of experiment `name`, created (as a model-training experiment) if missing."""
    found = client.get_experiment_by_name(name)
    if found is None:
        return client.create_experiment(name, tags={EXPERIMENT_KIND_TAG: TRAINING_KIND})
    if found.tags.get(EXPERIMENT_KIND_TAG) != TRAINING_KIND:
        client.set_experiment_tag(found.experiment_id, EXPERIMENT_KIND_TAG, TRAINING_KIND)
    return found.experiment_id


def flatten(data: Any, prefix: str = "") -> dict[str, str]:
    """{'a': {'b': 1}} -> {'a.b': '1'}; lists are JSON."""
    out: dict[str, str] = {}
    if isinstance(data, dict):
        for key, value in data.items():
            out |= flatten(value, f"{prefix}{key}.")
    else:
        out[prefix.rstrip(".")] = json.dumps(data) if isinstance(data, (list, tuple)) else str(data)
    return out


def end_job_run(tracking_uri: str, experiment: str, job_id: str, status: str = "FAILED") -> bool:
    """End job `job_id`'s run in `experiment` if it is still RUNNING (its process died before it could
    end it); True if it was."""
    client = mlflow_client(tracking_uri)
    found = client.get_experiment_by_name(experiment)
    if found is None:
        return False
    runs = client.search_runs([found.experiment_id], max_results=1,
                              filter_string=f"tags.`{JOB_TAG}` = '{job_id}' and attributes.status = 'RUNNING'")
    for run in runs:
        client.set_terminated(run.info.run_id, status=status)
    return bool(runs)


class Run:
    """One MLflow run: params, metrics, tags, files as artifacts, and its end."""

    def __init__(self, client, tracking_uri: str, experiment_id: str, run_id: str):
        self.client, self.tracking_uri, self.experiment_id, self.run_id = client, tracking_uri, experiment_id, run_id

    @classmethod
    def start(cls, experiment: str, run_name: str, tags: dict[str, str] | None = None, tracking_uri: str | None = None) -> Run:
        """A new run in `experiment` (created if missing)."""
        client = mlflow_client(tracking_uri)
        exp = experiment_id(client, experiment)
        run = client.create_run(exp, run_name=run_name, tags=tags or {})
        return cls(client, client.tracking_uri, exp, run.info.run_id)

    @property
    def run_url(self) -> str:
        return f"{self.tracking_uri.rstrip('/')}/#/experiments/{self.experiment_id}/runs/{self.run_id}"

    def log_params(self, params: dict[str, Any]) -> None:
        from mlflow.entities import Param

        items = [Param(k, str(v)[:6000]) for k, v in params.items()]
        for i in range(0, len(items), 100):
            self.client.log_batch(self.run_id, params=items[i : i + 100])

    def log_metrics(self, step: int, metrics: dict[str, Any]) -> None:
        """Numbers as metrics at `step`; text (e.g. `rollout/first_failure`) as the run's tags
        `opentinker.<key>`, the newest value, with the step it came from."""
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        items = [Metric(k, float(v), now, step) for k, v in metrics.items() if isinstance(v, (int, float))]
        for i in range(0, len(items), 500):
            self.client.log_batch(self.run_id, metrics=items[i : i + 500])
        self.set_tags({f"opentinker.{k}": f"step {step}: {v}"[:5000] for k, v in metrics.items() if isinstance(v, str)})

    def set_tags(self, tags: dict[str, Any]) -> None:
        for key, value in tags.items():
            self.client.set_tag(self.run_id, key, str(value))

    def log_files(self, files: dict[str, bytes | str], folder: str | None = None) -> None:
        """`files` ({name: content}) as artifacts under `folder`."""
        with tempfile.TemporaryDirectory() as tmp:
            for name, data in files.items():
                path = Path(tmp) / name
                path.write_bytes(data.encode() if isinstance(data, str) else data)
            self.client.log_artifacts(self.run_id, tmp, folder)

    def finish(self, status: str = "FINISHED") -> None:
        self.client.set_terminated(self.run_id, status=status)


class JobTracker(Run):
    """A job's run: one per job id in the job's experiment, found again when the job resumes."""

    def __init__(self, tracking_uri: str, experiment: str, job_id: str, spec, tags: dict[str, str] | None = None):
        from mlflow.tracking import MlflowClient

        client = MlflowClient(tracking_uri=tracking_uri)
        exp = experiment_id(client, experiment)
        runs = client.search_runs([exp], filter_string=f"tags.`{JOB_TAG}` = '{job_id}'", max_results=1)
        self.resumed = bool(runs)
        if runs:
            super().__init__(client, tracking_uri, exp, runs[0].info.run_id)
            client.update_run(self.run_id, status="RUNNING")
        else:
            run = client.create_run(exp, run_name=job_id, tags={JOB_TAG: job_id, **(tags or {})})
            super().__init__(client, tracking_uri, exp, run.info.run_id)
            self.log_params({**flatten(spec.model_dump(mode="json")), "job_id": job_id})  # the id given on the command line, too
            self.log_files({"spec.yaml": dump_spec(spec)})
        self.set_tags(tags or {})

    def log_steps(self, steps: list[tuple[int, dict[str, float]]]) -> None:
        """Each (step, metrics) of a committed checkpoint. A step trained again after resuming from an
        older checkpoint (see `mark_abandoned`) is logged anew: its newest values are the run's."""
        for step, metrics in steps:
            self.log_metrics(step, metrics)

    def mark_abandoned(self, resumed_at: int) -> list[int]:
        """Steps MLflow holds past `resumed_at`, the step a job resumes from: an earlier attempt trained
        them, but the checkpoint that covered them was not resumed (refused, or deleted), so the job
        trains them again. MLflow cannot delete a value, so the run's tag `opentinker.abandoned_steps`
        names them: at each, the older values are the abandoned attempt's and the newest the job's."""
        held = sorted({m.step for m in self.client.get_metric_history(self.run_id, STEP_KEY)} - set(range(resumed_at + 1)))
        if held:
            earlier = self.client.get_run(self.run_id).data.tags.get(ABANDONED_TAG, "")
            line = f"{', '.join(map(str, held))} (resumed from step {resumed_at} at {time.strftime('%Y-%m-%d %H:%M:%S')})"
            self.set_tags({ABANDONED_TAG: "; ".join(filter(None, [earlier, line]))[:5000]})
        return held

    def log_missing_metrics(self, steps: list[tuple[int, dict[str, float]]]) -> list[int]:
        """Log the steps (as a checkpoint carries them) that MLflow does not hold yet: a process
        killed between committing a checkpoint and logging its steps loses nothing, and a step
        already logged is not logged twice. Returns the steps logged now."""
        logged, held = [], {}
        for step, metrics in steps:
            numbers = sorted(k for k, v in metrics.items() if isinstance(v, (int, float)))
            if not numbers:
                continue
            key = numbers[0]  # text values are tags, with no history to ask
            if key not in held:
                held[key] = {m.step for m in self.client.get_metric_history(self.run_id, key)}
            if step in held[key]:
                continue
            self.log_metrics(step, metrics)
            held[key].add(step)
            logged.append(step)
        return logged

    def log_transcripts(self, step: int, transcripts: list[dict[str, Any]]) -> None:
        if not transcripts:
            return
        self.log_files({f"step-{step:06d}.json": json.dumps(transcripts, indent=1, default=str),
                        f"step-{step:06d}.html": transcripts_html(step, transcripts)}, "transcripts")

    def log_checkpoint(self, checkpoint_url: str, folder: str = "final", tag: str = "opentinker.checkpoint") -> None:
        """Copy the checkpoint's exportable model (the LoRA adapter, or the full weights) as
        artifacts under `folder`, and name the checkpoint in the run's `tag`."""
        import fsspec

        fs, path = fsspec.core.url_to_fs(checkpoint_url)
        source = f"{path}/adapter" if fs.exists(f"{path}/adapter") else path
        with tempfile.TemporaryDirectory() as tmp:
            fs.get(source.rstrip("/") + "/", tmp + "/", recursive=True)
            self.client.log_artifacts(self.run_id, tmp, folder)
        self.client.set_tag(self.run_id, tag, checkpoint_url)
