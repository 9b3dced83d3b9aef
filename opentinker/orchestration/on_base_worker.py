"""A flow's side of its pool's base-model worker (opentinker.orchestration.base_worker): find or
start the detached worker, host a Tinker session (`OnBaseWorker`) or a native LoRA job
(`JobOnBaseWorker`, RL or SFT) on it, call it, and take the session or job off it at the end."""

from __future__ import annotations

import os
import time
from typing import Any

from opentinker.orchestration.base_worker import NAMESPACE, BaseModelWorker, worker_name


class WorkerLost(RuntimeError):
    """The worker hosting a session died."""


def on_worker(num_gpus: float, idle_s: float, method: str, *args: Any, timeout_s: float = 600) -> tuple[Any, Any]:
    """(the pool's base-model worker, what its `method(*args)` returned), the worker found or
    started detached; one found closing (idle) is waited out and a new one started."""
    import ray

    from opentinker.control.scheduler import pool_for

    deadline = time.monotonic() + timeout_s
    while True:
        worker = ray.remote(BaseModelWorker).options(
            name=worker_name(pool_for(num_gpus)), namespace=NAMESPACE, lifetime="detached", get_if_exists=True, max_restarts=0,
            max_concurrency=16, num_cpus=1, num_gpus=1 if num_gpus > 0 else 0,
            # torch on every core of the node, as a job's own actor has it (Ray would set 1 thread for 1 CPU)
            runtime_env={"env_vars": {"OMP_NUM_THREADS": str(os.cpu_count() or 1), "TOKENIZERS_PARALLELISM": "false"}},
        ).remote(num_gpus, idle_s)
        try:
            return worker, ray.get(getattr(worker, method).remote(*args), timeout=max(1.0, deadline - time.monotonic()))
        except ray.exceptions.RayError as err:
            if "WorkerClosing" not in str(err) and not isinstance(err, ray.exceptions.RayActorError) or time.monotonic() > deadline:
                raise
            time.sleep(1.0)


class OnBaseWorker:
    """A flow's session hosted on its pool's base-model worker (found, or started detached)."""

    def __init__(self, num_gpus: float, idle_s: float, session_id: str, *host_args: Any):
        self.num_gpus, self.idle_s = num_gpus, idle_s
        self.session_id, self.host_args, self.worker = session_id, host_args, None

    def start(self, timeout_s: float = 600) -> dict[str, Any]:
        """Host the session; its URL."""
        self.worker, info = on_worker(self.num_gpus, self.idle_s, "host", self.session_id, *self.host_args, timeout_s=timeout_s)
        return info

    def status(self) -> dict[str, Any]:
        """The session's status; WorkerLost in one line when the worker died under it."""
        import ray

        try:
            return ray.get(self.worker.status.remote(self.session_id), timeout=60)
        except ray.exceptions.RayActorError:
            raise WorkerLost(f"session {self.session_id}: its base-model worker died (killed, out of memory, or its Ray node "
                             "went away); its clients resume from their last saved state in a new session") from None

    def stop(self) -> None:
        import ray

        ray.get(self.worker.drop.remote(self.session_id), timeout=60)
        self.worker = None  # off the worker: nothing left for kill()

    def kill(self) -> None:
        """The session off the worker, whatever happened (the worker stays for the others)."""
        import ray

        if self.worker is not None:
            try:
                ray.get(self.worker.drop.remote(self.session_id), timeout=60)
            except Exception:  # noqa: BLE001 - the worker is gone already
                pass


class JobOnBaseWorker:
    """A native LoRA job's actor side when it shares its base (`resources.share_base`): hosted on
    the pool's base-model worker; the step loop's calls go there (JobActors.call)."""

    def __init__(self, spec: Any, job_id: str, tenant: str | None, idle_s: float, host: str = "host_job"):
        """`host`: the worker's method that hosts it (`host_job` for RL, `host_sft`)."""
        self.worker, self.where = on_worker(spec.resources.num_gpus, idle_s, host, spec, job_id, tenant)
        self.key = self.where["key"]

    def line(self) -> str:
        return f"on the base-model worker (pid {self.where['pid']}): adapter {self.where['adapters']} of its {self.where['base']}"

    def call(self, method: str, *args: Any) -> Any:
        """An ObjectRef of the hosted job's `method(*args)`."""
        return self.worker.job_call.remote(self.key, method, *args)

    def kill(self) -> None:
        """The job off the worker, whatever happened (the worker stays for the others)."""
        import ray

        try:
            ray.get(self.worker.drop_job.remote(self.key), timeout=60)
        except Exception:  # noqa: BLE001 - the worker is gone already
            pass
