"""A Tinker session in a Ray actor: its models, samplers and server on the device Ray gives it.

The actor builds the session (opentinker.tinker.session) and serves it (opentinker.tinker.server)
on this node's listen address, published under the address other machines dial; the flow asks
`status` every second to learn whether the client finished or went quiet. Every optimizer step's
metrics go to the session's MLflow run from a background thread (no call waits on MLflow).
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import Any


log = logging.getLogger("opentinker.tinker")


def open_run(mlflow: tuple[str, str, str]) -> Any:
    """The session's MLflow run, from (tracking URI, experiment id, run id)."""
    from opentinker.tracking.runs import Run, mlflow_client

    uri, experiment_id, run_id = mlflow
    return Run(mlflow_client(uri), uri, experiment_id, run_id)


def step_metrics(model_id: str, metrics: dict[str, float]) -> dict[str, float]:
    """A training client's optimizer-step metrics as its session's run holds them: the first
    client's by their names (`loss`, `grad_norm`), client n's under `model<n>/`."""
    n = model_id.rsplit(":", 1)[-1]
    prefix = "" if n == "0" else f"model{n}/"
    return {f"{prefix}{k.split(':')[0]}": v for k, v in metrics.items()}


class TinkerSessionActor:
    def __init__(self, session_id: str, tenant: str, storage_url: str, token: str, num_gpus: float,
                 mlflow: tuple[str, str, str] | None = None):
        from opentinker.backend.device import placement
        from opentinker.core.settings import get_settings
        from opentinker.inference.server import serve_in_thread
        from opentinker.tinker.server import create_app
        from opentinker.tinker.session import TinkerSession

        settings = get_settings()
        self.metrics: queue.Queue = queue.Queue()
        self.steps = 0
        self.session = TinkerSession(session_id, tenant, storage_url, settings.models_folder, placement(num_gpus),
                                     on_step=lambda model_id, step, m: self.metrics.put((model_id, step, m)),
                                     max_call_tokens=settings.tinker_max_call_tokens)
        self.server = serve_in_thread(create_app(self.session, token), settings.listen_host, 0, model=session_id, engine="tinker")
        self.url = settings.advertised_url(self.server.url)
        self.mlflow = mlflow
        threading.Thread(target=self._log_steps, name="tinker-mlflow", daemon=True).start()
        threading.Thread(target=self._tick, name="tinker-tick", daemon=True).start()

    def _tick(self) -> None:
        import time

        while True:
            time.sleep(1.0)
            self.session.tick()

    def _log_steps(self) -> None:
        run = None
        while True:
            model_id, step, metrics = self.metrics.get()
            self.steps += 1
            if self.mlflow is None:
                continue
            try:
                run = run or open_run(self.mlflow)
                run.log_metrics(step, step_metrics(model_id, metrics))
            except Exception:  # noqa: BLE001 - a lost metric never fails a training call
                log.warning("could not log step %d to MLflow", step, exc_info=True)

    def info(self) -> dict[str, Any]:
        import os

        return {"url": self.url, "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES")}

    def status(self) -> dict[str, Any]:
        return {"idle_s": self.session.idle_seconds(), "finished": self.session.finished, "expired": self.session.expired, "steps": self.steps,
                "models": len(self.session.models)}

    def stop(self) -> None:
        self.server.stop()
        self.session.close()


class OwnActor:
    """A flow's session in a Ray actor (and a base) of its own."""

    def __init__(self, num_gpus: float, session_id: str, *actor_args: Any):
        import ray

        self.actor = ray.remote(TinkerSessionActor).options(name=f"{session_id}-session", num_cpus=1, num_gpus=num_gpus,
                                                            max_restarts=0).remote(session_id, *actor_args[:3], num_gpus, actor_args[3])

    def start(self, timeout_s: float = 600) -> dict[str, Any]:
        import ray

        return ray.get(self.actor.info.remote(), timeout=timeout_s)

    def status(self) -> dict[str, Any]:
        import ray

        return ray.get(self.actor.status.remote(), timeout=60)

    def stop(self) -> None:
        import ray

        ray.get(self.actor.stop.remote(), timeout=60)

    def kill(self) -> None:
        import ray

        ray.kill(self.actor)
