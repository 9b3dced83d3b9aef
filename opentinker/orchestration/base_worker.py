"""A base-model worker: one Ray actor per pool that hosts many Tinker sessions, of any tenants,
whose training clients share one copy of each base model (opentinker.tinker.shared_bases): their
calls run in passes that take turns between tenants (on a GPU, joined into one batch, each row
through its own adapter).

Why: a LoRA tenant needs its adapter and optimizer state, not a base of its own; eight small
sessions on one worker hold one base, not eight.

Each hosted session keeps what made it a session (opentinker.tinker.session: its models,
samplers, futures, checkpoints in its tenant's storage), its own server door under the worker's
(`<worker>/s/<session_id>/…`, guarded by that session's job token, so the gateway relays as to any
session) and its MLflow run; its Prefect flow run holds one of the worker's seats and lives as long
as the session. The worker is a detached, named actor: the first session's flow starts it, the
next ones find it; `drop` takes a session (and its adapters) off; with no session left for
`idle_s` it closes and exits, and a flow that finds it closing starts a new one.

It hosts native LoRA RL jobs too (`resources.share_base`): the job's policy and sampler
(opentinker.rl.RLJob) over its adapter of the base (`host_job`), the flow's step tasks calling
in (`job_call`), its episodes sampled by the base's shared engine in batches with every other
adapter's rows. On a GPU (the base's `joint_updates`) the per-sequence micro-batches of jobs that
update together run as joint passes, each row through its job's adapter (opentinker.backend.
shared_base); on a CPU updates (a job's, or a pass of Tinker clients) take the base's training lock
in turn: a training pass's matmuls already fill every core, so joining them buys nothing, while a
job's own pass keeps its shared-prefix saving (opentinker.backend.shared_prefix). SFT LoRA
jobs are hosted the same way (`host_sft`): one optimizer step a call (opentinker.sft.shared), under
the same lock, so a long SFT run never holds the base between its steps.
"""

from __future__ import annotations

import functools
import logging
import os
import queue
import threading
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("opentinker.tinker")
NAMESPACE = "opentinker-base-workers"


def worker_name(pool: str) -> str:
    return f"base-worker-{pool}"


def worker_memory_bytes(settings: Any, num_gpus: float) -> float:
    """tinker_worker_memory_gb, else the GPU's memory, else half of this machine's RAM."""
    if settings.tinker_worker_memory_gb is not None:
        return settings.tinker_worker_memory_gb * 2**30
    if num_gpus > 0:
        import torch

        return float(torch.cuda.get_device_properties(0).total_memory)
    import psutil

    return psutil.virtual_memory().total / 2


class WorkerClosing(RuntimeError):
    """This worker is going away (idle): start a new one."""


@dataclass
class Hosted:
    session: Any  # TinkerSession
    app: Any
    mlflow: tuple[str, str, str] | None
    steps: int = 0
    run: Any = None  # its MLflow run, opened at its first step


# What a flow may call on a hosted job: an RL job's step loop, an SFT job's (opentinker.sft.shared)
JOB_CALLS = ("restore", "rollout", "update", "evaluate", "checkpoint", "begin", "step", "finish")
TRAINING_CALLS = ("update", "step")  # they take the base's training lock, one pass at a time
# Forward/backward passes with no sampling in them (a call that samples waits for the engine, which
# decodes on the compute thread: it runs in its caller's thread)
COMPUTE_CALLS = ("update", "step", "begin", "finish")


def return_freed_memory() -> None:
    """Give the heap's free pages back to the system (glibc's malloc_trim; elsewhere nothing).

    Why: each of the worker's threads (one per call in flight) gets a malloc arena of its own,
    which keeps the peak of what its calls allocated: measured with three SmolLM2 jobs after two
    steps each, 4.4 GB resident, 1.8 GB after a trim. A trim costs milliseconds against a step's seconds."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@functools.cache
def _malloc_trim() -> Any:
    """glibc's malloc_trim, looked up once (find_library runs ldconfig); None elsewhere."""
    import ctypes
    import ctypes.util

    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc
        return None


def adapter_name(job_id: str, tenant: str | None) -> str:
    """A hosted job's adapter on its base: never a Tinker model id (those hold a `:`), never another tenant's job."""
    return f"job/{tenant or '-'}/{job_id}"


# A hosted job whose flow made no call for this long is a leftover (its flow process died with no
# one to take it off): a new run of the job id replaces it. A live flow calls step after step.
LEFTOVER_S = 60.0


@dataclass
class HostedJob:
    job: Any  # opentinker.rl.RLJob, or opentinker.sft.shared.SharedSFT
    model: Any  # its AdapterModel
    shared: Any  # the SharedBase it is an adapter of
    calls: int = 0  # in flight
    last_call: float = field(default_factory=time.monotonic)  # when the last call ended (or the job was hosted)

    def idle_seconds(self) -> float:
        return 0.0 if self.calls else time.monotonic() - self.last_call

    def locks_base(self, method: str) -> bool:
        """Does the call hold the base's training lock throughout? Not a joint update: the base's
        runner takes the lock for each of its passes."""
        trainer = getattr(getattr(self.job, "policy", None), "trainer", None)
        return method in TRAINING_CALLS and not (method == "update" and getattr(trainer, "joint", None) is not None)


class SessionRouter:
    """ASGI: `/s/<session_id>/<rest>` goes to that session's own app (as `/<rest>`); anything else is 404."""

    def __init__(self) -> None:
        self.apps: dict[str, Any] = {}

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        parts = scope.get("path", "").split("/", 3)  # "", "s", session, rest
        app = self.apps.get(parts[2]) if len(parts) >= 3 and parts[1] == "s" else None
        if app is None:
            if scope["type"] == "http":
                await send({"type": "http.response.start", "status": 404,
                            "headers": [(b"content-type", b"application/json"), (b"x-opentinker-no-session", b"1")]})
                await send({"type": "http.response.body", "body": b'{"detail": "no such session on this worker"}'})
            return
        rest = "/" + (parts[3] if len(parts) == 4 else "")
        await app({**scope, "path": rest, "raw_path": rest.encode()}, receive, send)


class BaseModelWorker:
    def __init__(self, num_gpus: float, idle_s: float):
        from opentinker.backend.device import placement
        from opentinker.core.settings import get_settings
        from opentinker.inference.server import serve_in_thread
        from opentinker.tinker.shared_bases import SharedBases

        self.settings = get_settings()
        self.placement = placement(num_gpus)
        self.bases = SharedBases(self.settings.models_folder, self.placement, memory_bytes=worker_memory_bytes(self.settings, num_gpus))
        self.hosted: dict[str, Hosted] = {}
        self.jobs: dict[str, HostedJob] = {}  # native LoRA jobs, by job id
        self.router = SessionRouter()
        self.lock = threading.Lock()
        self.idle_s, self.empty_since, self.closing, self.closed = idle_s, time.monotonic(), False, False
        self.server = serve_in_thread(self.router, self.settings.listen_host, 0, model="base-worker", engine="tinker")
        self.url = self.settings.advertised_url(self.server.url)
        self.metrics: queue.Queue = queue.Queue()
        threading.Thread(target=self._log_steps, name="tinker-mlflow", daemon=True).start()
        threading.Thread(target=self._tick, name="base-worker-tick", daemon=True).start()

    # -- sessions ---------------------------------------------------------------------------
    def host(self, session_id: str, tenant: str, storage_url: str, token: str, mlflow: tuple[str, str, str] | None) -> dict[str, Any]:
        """Host a new session; its URL (the gateway relays there with `token`)."""
        from opentinker.tinker.server import create_app
        from opentinker.tinker.session import TinkerSession

        with self.lock:
            if self.closing:
                raise WorkerClosing("this base-model worker is closing (idle): start another")
            session = TinkerSession(session_id, tenant, storage_url, self.settings.models_folder, self.placement,
                                    on_step=lambda model_id, step, m: self.metrics.put((session_id, model_id, step, m)),
                                    trainers=self.bases, engines=self.bases.sampler_engines, max_call_tokens=self.settings.tinker_max_call_tokens)
            self.hosted[session_id] = Hosted(session, create_app(session, token), mlflow)
            self.router.apps[session_id] = self.hosted[session_id].app
        return {"url": f"{self.url}/s/{session_id}"}

    def status(self, session_id: str) -> dict[str, Any]:
        """The session's (as a session actor's status), and a line on what the worker holds."""
        hosted = self.hosted[session_id]
        bases = "; ".join(f"{name}: {s['adapters']} adapter(s), {s['batch_share']:.0%} of passes shared"
                          for name, s in self.bases.stats().items())
        return {"idle_s": hosted.session.idle_seconds(), "finished": hosted.session.finished, "expired": hosted.session.expired,
                "steps": hosted.steps,
                "models": len(hosted.session.models), "worker": f" · base-model worker: {len(self.hosted)} session(s); {bases or 'no base loaded'}"}

    def drop(self, session_id: str) -> None:
        """The session leaves: its door closes, its adapters leave their bases."""
        with self.lock:
            hosted = self.hosted.pop(session_id, None)
            self.router.apps.pop(session_id, None)
            if not self.hosted:
                self.empty_since = time.monotonic()
        if hosted is not None:
            hosted.session.close()

    # -- native jobs ------------------------------------------------------------------------
    def host_job(self, spec: Any, job_id: str, tenant: str | None) -> dict[str, Any]:
        """Host a native LoRA RL job (`resources.share_base`): its adapter on the base it names, its
        policy and sampler the job's own (opentinker.rl.RLJob) over that adapter, its episodes
        sampled by the base's shared engine, batched with other jobs' and sessions' requests.
        Returns where it is (`key`: the job's name here, its adapter's, which holds its tenant)."""
        from opentinker.inference.engine_multi_lora import AdapterRollouts
        from opentinker.rl import RLJob

        def rl_job(shared: Any, model: Any, key: str, closing: list) -> Any:
            rollouts = AdapterRollouts(self.bases.engines.engine(spec.model.name), key, spec.seed)
            closing.append(rollouts.close)
            job = RLJob(spec, job_id, tenant=tenant, model=model, tokenizer=shared.tokenizer, rollout_engine=rollouts)
            if shared.joint_updates:  # its micro-batches join other jobs' passes (the runner takes the lock per pass)
                job.policy.trainer.joint = functools.partial(shared.joint_update, key)
            return job

        return self._host(spec, job_id, tenant, spec.seed, rl_job)

    def host_sft(self, spec: Any, job_id: str, tenant: str | None) -> dict[str, Any]:
        """Host an SFT LoRA job (`resources.share_base`): its adapter on the base it names, trained by
        the flow's `begin`, `step`… `finish` calls (opentinker.sft.shared). Returns where it is, as `host_job`."""
        from opentinker.sft.shared import SharedSFT

        return self._host(spec, job_id, tenant, spec.training.seed, lambda shared, model, key, closing: SharedSFT(spec, job_id, tenant, model))

    def _host(self, spec: Any, job_id: str, tenant: str | None, seed: int, make: Any) -> dict[str, Any]:
        key = adapter_name(job_id, tenant)
        with self.lock:
            if self.closing:
                raise WorkerClosing("this base-model worker is closing (idle): start another")
            earlier = self.jobs.get(key, False)
            if earlier is not False and (earlier is None or earlier.idle_seconds() < LEFTOVER_S):
                raise ValueError(f"job {job_id} is hosted here already, and its run made a call in the last {LEFTOVER_S:g} s: "
                                 "is another run of it going on?")
            self.jobs[key] = None  # taken while the base loads
        if earlier:
            log.warning("job %s: a leftover of an earlier run (no call for %.0f s) replaced", key, earlier.idle_seconds())
            self._drop_hosted(key, earlier)
        shared = model = None
        closing: list = []  # what to close if the job cannot start
        try:
            shared = self.bases.base(spec.model.name)
            lora = spec.adapter
            model = shared.add_job(key, lora.r, lora.alpha, lora.target_modules, lora.dropout, seed)
            with model.using():
                job = make(shared, model, key, closing)
        except BaseException:
            for close in closing:
                close()
            if model is not None:
                shared.multi.remove(key)
            self._forget_job(key)
            raise
        self.jobs[key] = HostedJob(job, model, shared)
        return {"key": key, "pid": os.getpid(), "adapters": len(shared.multi.adapters), "base": spec.model.name}

    def job_call(self, key: str, method: str, *args: Any) -> Any:
        """One of the step loop's calls of a hosted job, every forward in it through the job's adapter."""
        if method not in JOB_CALLS:
            raise ValueError(f"no such job call: {method}")
        with self.lock:
            hosted = self.jobs.get(key)
            if hosted is None:
                raise LookupError(f"job {key.rsplit('/', 1)[-1]} is not hosted on this base-model worker (taken off after "
                                  f"{2 * self.settings.tinker_heartbeat_timeout_s:g} s without a call, or by a new run of it): "
                                  "resubmit it to resume from its last checkpoint")
            hosted.calls += 1
        try:
            with hosted.model.using(), hosted.shared.training if hosted.locks_base(method) else nullcontext():
                if method in COMPUTE_CALLS:  # on the worker's compute thread, as its sampling (opentinker.backend.compute_thread)
                    from opentinker.backend import compute_thread

                    return compute_thread.run_on(self.placement.device, getattr(hosted.job, method), *args)
                return getattr(hosted.job, method)(*args)
        finally:
            with self.lock:
                hosted.calls -= 1
                hosted.last_call = time.monotonic()
            if method in ("rollout", "update", "evaluate", "begin", "finish"):
                return_freed_memory()

    def drop_job(self, key: str) -> None:
        """The job leaves: its sampler stops using the engine, its adapter leaves the base."""
        hosted = self.jobs.get(key)
        if hosted is not None:
            self._drop_hosted(key, hosted)
        self._forget_job(key)

    def _drop_hosted(self, key: str, hosted: HostedJob) -> None:
        if hasattr(hosted.job, "close"):  # an RL job's sampler
            hosted.job.close()
        hosted.model.multi.remove(key)

    def _forget_job(self, key: str) -> None:
        with self.lock:
            self.jobs.pop(key, None)
            if not self.hosted and not self.jobs:
                self.empty_since = time.monotonic()

    def info(self) -> dict[str, Any]:
        """What the worker hosts: sessions, each base's adapters and how often calls shared a pass."""
        return {"url": self.url, "pid": os.getpid(), "sessions": sorted(self.hosted), "jobs": sorted(self.jobs),
                "adapters": self.bases.adapters(), "bases": self.bases.stats(), "sampling": self.bases.sampling_stats()}

    # -- background -------------------------------------------------------------------------
    def _tick(self) -> None:
        """Sessions' housekeeping; a session whose flow died without taking it off (its client quiet
        twice the heartbeat timeout: the flow would have ended it) is dropped, and so is a hosted job
        whose flow made no call for as long; an idle worker exits."""
        while True:
            time.sleep(1.0)
            if self.closed:  # by its owner
                return
            for session_id, hosted in list(self.hosted.items()):
                hosted.session.tick()
                if hosted.session.idle_seconds() > 2 * self.settings.tinker_heartbeat_timeout_s:
                    log.warning("session %s: no call for %.0f s and no flow took it off: dropped", session_id, hosted.session.idle_seconds())
                    self.drop(session_id)
            for key, job in self._stale_jobs(2 * self.settings.tinker_heartbeat_timeout_s):  # flows that died
                log.warning("job %s: no call for %.0f s: taken off", key, job.idle_seconds())
                self._drop_hosted(key, job)
                self._forget_job(key)
            with self.lock:
                idle = not self.hosted and not self.jobs and time.monotonic() - self.empty_since > self.idle_s
                if idle:
                    self.closing = True
            if idle:
                log.info("base-model worker idle for %.0f s: exiting", self.idle_s)
                self.close()
                import ray

                if ray.is_initialized() and ray.get_runtime_context().get_actor_id():  # not a worker built in-process
                    ray.kill(ray.get_runtime_context().current_actor, no_restart=True)
                return

    def close(self) -> None:
        """Stop serving and free the bases; the tick ends at its next second (idle exit, or a worker
        built in-process that its owner closes: its threads must not outlive it)."""
        with self.lock:
            self.closing = True
            if self.closed:
                return
            self.closed = True
        self.server.stop()
        self.bases.close()

    def _stale_jobs(self, idle_s: float) -> list[tuple[str, HostedJob]]:
        """Hosted jobs with no call for `idle_s`, taken out of `jobs` (no call can start on them now)."""
        with self.lock:
            stale = [(key, job) for key, job in self.jobs.items() if job is not None and job.idle_seconds() > idle_s]
            for key, _ in stale:
                del self.jobs[key]
        return stale

    def _log_steps(self) -> None:
        from opentinker.orchestration.tinker_actor import open_run, step_metrics

        while True:
            session_id, model_id, step, metrics = self.metrics.get()
            hosted = self.hosted.get(session_id)
            if hosted is None:
                continue
            hosted.steps += 1
            if hosted.mlflow is None:
                continue
            try:
                hosted.run = hosted.run or open_run(hosted.mlflow)
                shares = [b["batch_share"] for b in self.bases.stats().values()]  # how often calls shared a pass, so far
                hosted.run.log_metrics(step, {**step_metrics(model_id, metrics), "worker/batch_share": sum(shares) / max(1, len(shares))})
            except Exception:  # noqa: BLE001 - a lost metric never fails a training call
                log.warning("could not log step %d of %s to MLflow", step, session_id, exc_info=True)
