"""The job's state in long-lived Ray actors, for the whole job; Prefect tasks call them by handle.

The actors are the runtime's own classes, hosted by Ray, with no wrapper in between:
- colocated (`resources.colocate: true`, the default): one `RLJob` actor, the policy and the
  sampler sharing one model copy (on a GPU: one copy in device memory); weight sync is the
  version handshake;
- split (`colocate: false`, and every job with `algorithm.max_staleness` > 0, whose producer plays
  while the trainer updates): a `Policy` actor and a `Sampler` actor with their own model copies;
  after every update the policy's trainable weights go to the sampler, tagged with their version;
- shared (`resources.share_base: true`, LoRA): hosted on the pool's base-model worker, its adapter
  on the worker's one copy of the base, its episodes batched with other tenants' there;
- self-play: one `SelfPlayJob` actor holding every agent's policy.
Trajectories travel actor to actor through Ray's object store, never through Prefect.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

from opentinker.core.spec import JobSpec
from opentinker.tools.sandbox import OWNER_ENV

log = logging.getLogger(__name__)


def _job_log() -> logging.Logger | logging.LoggerAdapter:
    """The flow run's logger (the job's log) inside a run, this module's outside one."""
    from prefect.exceptions import MissingContextError
    from prefect.logging import get_run_logger

    try:
        return get_run_logger()
    except MissingContextError:
        return log


@dataclass
class JobActors:
    """Handles of one RL job's actors: `job` (colocated), or `policy` and `sampler` (split), or
    `hosted`: the job on its base's shared worker (opentinker.orchestration.base_worker)."""

    job: Any = None
    policy: Any = None
    sampler: Any = None
    hosted: Any = None
    ranks: Any = None  # the policy on every rank of a sharded trainer: a RankGroup (resources.trainer_ranks > 1)
    engine_choice: str | None = None  # how `rollout.engine: auto` was decided (opentinker.rl.engine_choice)

    @property
    def colocated(self) -> bool:
        return self.job is not None or self.hosted is not None

    def call(self, method: str, *args: Any) -> Any:
        """An ObjectRef of the colocated job's `method(*args)`, wherever it is hosted."""
        if self.hosted is not None:
            return self.hosted.call(method, *args)
        return getattr(self.job, method).remote(*args)

    def train(self, method: str, *args: Any) -> Any:
        """An ObjectRef of the split layout's policy's `method(*args)`: its actor's, or rank 0's of a
        sharded trainer once every rank's ended (a rank that died fails it in one line)."""
        if self.ranks is not None:
            return self.ranks.call_ref(method, *args)
        return getattr(self.policy, method).remote(*args)

    def sample(self, method: str, *args: Any) -> Any:
        """An ObjectRef of `method(*args)` on what plays episodes (rollout, evaluate)."""
        return self.call(method, *args) if self.colocated else getattr(self.sampler, method).remote(*args)

    def kill(self) -> None:
        import ray

        if self.hosted is not None:
            self.hosted.kill()
        if self.ranks is not None:
            self.ranks.close()
        for handle in (self.job, self.policy, self.sampler):
            if handle is not None:
                ray.kill(handle)


def streams_apart(spec: JobSpec) -> bool:
    """Does the job's producer play while its trainer updates (max_staleness > 0)? Then the two
    are actors of their own (the split layout), whatever `resources.colocate` says."""
    algorithm = getattr(spec, "algorithm", None)  # an SFT job has none: no producer
    return algorithm is not None and algorithm.max_staleness > 0


def actor_options(spec: JobSpec, name: str, owner: str) -> dict[str, Any]:
    """Ray options from the spec's resources; torch threads through OMP_NUM_THREADS (Ray would set
    1 for an actor holding fewer than 2 CPUs, halving torch's speed on a 2-core machine). A job whose
    producer and trainer compute at once on the CPU splits the cores between them. `owner`
    ("tenant/job") is whose sandboxed calls the actor makes: the sandbox shares its slots and the
    CPU fairly between owners (opentinker/tools/sandbox.py)."""
    r = spec.resources
    cores = os.cpu_count() or 1
    threads = str(r.torch_threads or (max(1, cores // 2) if streams_apart(spec) and r.num_gpus == 0 else cores))
    return {"name": name, "num_cpus": r.num_cpus, "num_gpus": r.num_gpus, "max_restarts": 0,
            "runtime_env": {"env_vars": {"OMP_NUM_THREADS": threads, "TOKENIZERS_PARALLELISM": "false", OWNER_ENV: owner}}}


def create_actors(spec: JobSpec, job_id: str, tenant: str | None = None) -> JobActors:
    """Start the job's actors with the resources the spec asks for, and wait until they are up;
    `tenant`: whose job (its checkpoints are signed as such)."""
    import ray

    from opentinker.inference.launch import rollout_server
    from opentinker.rl import Policy, RLJob, Sampler
    from opentinker.rl.engine_choice import choose_engine
    from opentinker.rl.policy import with_pinned_init_from

    owner = f"{tenant or 'operator'}/{job_id}"
    if spec.resources.share_base:
        from opentinker.core.settings import get_settings
        from opentinker.orchestration.on_base_worker import JobOnBaseWorker

        return JobActors(hosted=JobOnBaseWorker(spec, job_id, tenant, get_settings().tinker_worker_idle_s))
    spec, choice = choose_engine(spec, starts_servers=True)  # here, once: trainer and sampler must agree on how it samples
    if spec.resources.trainer_ranks > 1:
        return _sharded_actors(with_pinned_init_from(spec, job_id, tenant), job_id, tenant, owner, choice)
    if spec.resources.colocate and not streams_apart(spec):
        job = ray.remote(RLJob).options(**actor_options(spec, f"{job_id}-colocated", owner)).remote(spec, job_id, start_server=rollout_server, tenant=tenant)
        ray.get(job.__ray_ready__.remote())
        _job_log().info(f"job {job_id}: {ray.get(job.precision.remote())}")  # decided where the trainer runs (its CPU's flags)
        return JobActors(job=job, engine_choice=choice)
    spec = with_pinned_init_from(spec, job_id, tenant)  # the sampler and its server know no tenant: one base for both sides
    policy = ray.remote(Policy).options(**actor_options(spec, f"{job_id}-policy", owner)).remote(spec, job_id, tenant=tenant)
    sampler = ray.remote(Sampler).options(**actor_options(spec, f"{job_id}-sampler", owner)).remote(spec, job_id=job_id, start_server=rollout_server)
    ray.get([policy.__ray_ready__.remote(), sampler.__ray_ready__.remote()])
    ray.get(sampler.sync.remote(policy.weights.remote()))  # identical starting weights (LoRA init is random)
    _job_log().info(f"job {job_id}: {ray.get(policy.precision.remote())}")  # decided where the trainer runs (its CPU's flags)
    return JobActors(policy=policy, sampler=sampler, engine_choice=choice)


def _sharded_actors(spec: JobSpec, job_id: str, tenant: str | None, owner: str, choice: str | None) -> JobActors:
    """The job's policy on each of `resources.trainer_ranks` ranks (one placement group, one
    process group: opentinker.orchestration.ranks) and its sampler as an actor of its own."""
    import ray

    from opentinker.inference.launch import rollout_server
    from opentinker.orchestration.ranks import RankGroup
    from opentinker.rl import Policy, Sampler

    r = spec.resources
    env = actor_options(spec, f"{job_id}-ranks", owner)["runtime_env"]["env_vars"]
    threads = r.torch_threads or max(1, (os.cpu_count() or 1) // r.trainer_ranks)  # the ranks update while the sampler waits
    ranks = RankGroup(r.trainer_ranks, cpus_per_rank=r.num_cpus, spread=r.trainer_placement == "spread", env_vars=env | {"OMP_NUM_THREADS": str(threads)})
    sampler = None
    try:
        sampler = ray.remote(Sampler).options(**actor_options(spec, f"{job_id}-sampler", owner)).remote(spec, job_id=job_id, start_server=rollout_server)
        ranks.host(Policy, spec, job_id, tenant=tenant, seed=spec.seed)
        ray.get(sampler.sync.remote(ranks.call_ref("weights")))  # identical starting weights
    except BaseException:
        ranks.close()
        if sampler is not None:
            ray.kill(sampler)
        raise
    _job_log().info(f"job {job_id}: trainer sharded over {r.trainer_ranks} ranks ({', '.join(p['address'] for p in ranks.places)}); "
                    f"{ranks.call('precision')}")
    return JobActors(ranks=ranks, sampler=sampler, engine_choice=choice)


def create_selfplay_actor(spec: JobSpec, job_id: str, tenant: str | None = None) -> Any:
    """A self-play job's agents in one actor (on CPU they share the cores anyway)."""
    import ray

    from opentinker.rl.selfplay import SelfPlayJob

    owner = f"{tenant or 'operator'}/{job_id}"
    handle = ray.remote(SelfPlayJob).options(**actor_options(spec, f"{job_id}-agents", owner)).remote(spec, job_id, tenant=tenant)
    ray.get(handle.__ray_ready__.remote())
    return handle


def check_placeable(spec: JobSpec) -> None:
    """Fail now, with the numbers, when the cluster can never place the job's actors (Ray would wait forever)."""
    import ray

    total = ray.cluster_resources()
    r = spec.resources
    apart = not r.colocate or streams_apart(spec) or r.trainer_ranks > 1
    need_cpu = r.num_cpus * (1 + r.trainer_ranks if r.trainer_ranks > 1 else 2 if apart else 1)
    need_gpu = r.num_gpus * (2 if apart else 1)
    if need_gpu > total.get("GPU", 0):
        raise RuntimeError(f"resources.num_gpus: the job needs {need_gpu:g} GPU(s), the Ray cluster has {total.get('GPU', 0):g}")
    if need_cpu > total.get("CPU", 0):
        raise RuntimeError(f"resources.num_cpus: the job needs {need_cpu:g} CPU(s), the Ray cluster has {total.get('CPU', 0):g}")
