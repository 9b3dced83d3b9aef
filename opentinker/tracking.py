"""MLflow bookkeeping for a job: one run per job id (found again on resume), an experiment per
project, params = the flattened spec, per-step metrics, transcripts and the final adapter."""

from __future__ import annotations

import html
import json
import tempfile
import time
from pathlib import Path
from typing import Any

from opentinker.spec import JobSpec, dump_spec

JOB_TAG = "opentinker.job_id"


def headline_key(metric_keys, name: str) -> str:
    """The key to show for `name` (e.g. "rollout/reward_mean"): itself, or for a self-play job
    an agent's (`O/rollout/reward_mean`, the first in sorted order)."""
    keys = sorted(metric_keys)
    return name if name in keys else next((k for k in keys if k.endswith("/" + name)), name)


def flatten(data: Any, prefix: str = "") -> dict[str, str]:
    """{'a': {'b': 1}} -> {'a.b': '1'}; lists are JSON."""
    out: dict[str, str] = {}
    if isinstance(data, dict):
        for key, value in data.items():
            out |= flatten(value, f"{prefix}{key}.")
    else:
        out[prefix.rstrip(".")] = json.dumps(data) if isinstance(data, (list, tuple)) else str(data)
    return out


def transcripts_html(step: int, transcripts: list[dict[str, Any]]) -> str:
    """A small self-contained page: one block per episode, messages in order, reward and info."""
    blocks = []
    for i, t in enumerate(transcripts):
        msgs = "".join(
            f"<div class='m {html.escape(m['role'])}'><b>{html.escape(m['role'])}</b><pre>{html.escape(m['content'])}</pre></div>"
            for m in t["messages"]
        )
        status = "failed: " + html.escape(str(t.get("failure"))) if t.get("failed") else f"reward {t['reward']:.3g}"
        blocks.append(f"<section><h3>episode {i} — {status}</h3>{msgs}<p class='info'>{html.escape(json.dumps(t.get('info', {})))}</p></section>")
    style = "body{font-family:sans-serif;max-width:60em;margin:auto}pre{white-space:pre-wrap;margin:0}.m{padding:.3em;margin:.2em 0;border-left:3px solid #ccc}.assistant{border-color:#36c}.user{border-color:#3a3}.info{color:#666}"
    return f"<!doctype html><meta charset='utf-8'><title>step {step}</title><style>{style}</style><h1>Evaluation transcripts, step {step}</h1>{''.join(blocks)}"


class JobTracker:
    def __init__(self, tracking_uri: str, experiment: str, job_id: str, spec: JobSpec, tags: dict[str, str] | None = None):
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(tracking_uri=tracking_uri)
        self.tracking_uri = tracking_uri
        found = self.client.get_experiment_by_name(experiment)
        self.experiment_id = found.experiment_id if found else self.client.create_experiment(experiment)
        runs = self.client.search_runs([self.experiment_id], filter_string=f"tags.`{JOB_TAG}` = '{job_id}'", max_results=1)
        self.resumed = bool(runs)
        if runs:
            self.run_id = runs[0].info.run_id
            self.client.update_run(self.run_id, status="RUNNING")
        else:
            run = self.client.create_run(self.experiment_id, run_name=job_id, tags={JOB_TAG: job_id, **(tags or {})})
            self.run_id = run.info.run_id
            self._log_params(flatten(spec.model_dump(mode="json")))
            self._log_text(dump_spec(spec), "spec.yaml")
        for key, value in (tags or {}).items():
            self.client.set_tag(self.run_id, key, value)

    @property
    def run_url(self) -> str:
        return f"{self.tracking_uri.rstrip('/')}/#/experiments/{self.experiment_id}/runs/{self.run_id}"

    def _log_params(self, params: dict[str, str]) -> None:
        from mlflow.entities import Param

        items = [Param(k, v[:6000]) for k, v in params.items()]
        for i in range(0, len(items), 100):
            self.client.log_batch(self.run_id, params=items[i : i + 100])

    def _log_text(self, text: str, name: str, folder: str | None = None) -> None:
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / name
            path.write_text(text)
            self.client.log_artifact(self.run_id, str(path), folder)

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        items = [Metric(k, float(v), now, step) for k, v in metrics.items()]
        for i in range(0, len(items), 500):
            self.client.log_batch(self.run_id, metrics=items[i : i + 500])

    def log_missing_metrics(self, steps: list[tuple[int, dict[str, float]]]) -> list[int]:
        """Log the steps (as a checkpoint carries them) that MLflow does not hold yet: a process
        killed between committing a checkpoint and logging its steps loses nothing, and a step
        already logged is not logged twice. Returns the steps logged now."""
        logged = []
        for step, metrics in steps:
            if not metrics:
                continue
            key = sorted(metrics)[0]
            if any(m.step == step for m in self.client.get_metric_history(self.run_id, key)):
                continue
            self.log_metrics(step, metrics)
            logged.append(step)
        return logged

    def log_transcripts(self, step: int, transcripts: list[dict[str, Any]]) -> None:
        self._log_text(json.dumps(transcripts, indent=1, default=str), f"step-{step:06d}.json", "transcripts")
        self._log_text(transcripts_html(step, transcripts), f"step-{step:06d}.html", "transcripts")

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

    def finish(self, status: str = "FINISHED") -> None:
        self.client.set_terminated(self.run_id, status=status)
