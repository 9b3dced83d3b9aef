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

import os
from dataclasses import dataclass, field
from typing import Any

from opentinker.core.spec import JobSpec
from opentinker.orchestration.layout import Layout, streams_apart
from opentinker.tools.sandbox import OWNER_ENV


@dataclass
class JobActors:
    """Handles of one RL job's actors: `job` (colocated), or `policy` and `sampler` (split), or
    `hosted`: the job on its base's shared worker (opentinker.orchestration.base_worker)."""

    job: Any = None
    policy: Any = None
    sampler: Any = None
    hosted: Any = None
    ranks: Any = None  # the policy on every rank of a sharded trainer: a RankGroup (resources.trainer_ranks > 1)
    where: dict[str, str] = field(default_factory=dict)  # where it runs, one line each, by MLflow tag

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


def create_actors(layout: Layout, job_id: str, tenant: str | None = None) -> JobActors:
    """Start the job's actors as its layout says (orchestration.layout, decided once), and wait
    until they are up; `tenant`: whose job (its checkpoints are signed as such). Their `where`
    lines say where it runs, for the job's log and its MLflow tags."""
    import ray

    from opentinker.inference.launch import rollout_server
    from opentinker.rl import Policy, RLJob, Sampler

    spec, owner = layout.spec, f"{tenant or 'operator'}/{job_id}"
    engine = {"opentinker.rollout_engine": layout.engine_choice} if layout.engine_choice else {}
    if layout.kind == "hosted":
        from opentinker.core.settings import get_settings
        from opentinker.orchestration.on_base_worker import JobOnBaseWorker

        hosted = JobOnBaseWorker(spec, job_id, tenant, get_settings().tinker_worker_idle_s)
        return JobActors(hosted=hosted, where={"opentinker.base_worker": hosted.line()})
    if layout.kind == "sharded":
        return _sharded_actors(spec, job_id, tenant, owner, engine)
    if layout.kind == "colocated":
        job = ray.remote(RLJob).options(**actor_options(spec, f"{job_id}-colocated", owner)).remote(spec, job_id, start_server=rollout_server, tenant=tenant)
        ray.get(job.__ray_ready__.remote())
        return JobActors(job=job, where={"opentinker.trainer": ray.get(job.precision.remote()), **engine})  # its CPU's flags decide
    policy = ray.remote(Policy).options(**actor_options(spec, f"{job_id}-policy", owner)).remote(spec, job_id, tenant=tenant)
    sampler = ray.remote(Sampler).options(**actor_options(spec, f"{job_id}-sampler", owner)).remote(spec, job_id=job_id, start_server=rollout_server)
    ray.get([policy.__ray_ready__.remote(), sampler.__ray_ready__.remote()])
    ray.get(sampler.sync.remote(policy.weights.remote()))  # identical starting weights (LoRA init is random)
    return JobActors(policy=policy, sampler=sampler, where={"opentinker.trainer": ray.get(policy.precision.remote()), **engine})


def _sharded_actors(spec: JobSpec, job_id: str, tenant: str | None, owner: str, engine: dict[str, str]) -> JobActors:
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
    trainer = f"trainer sharded over {r.trainer_ranks} ranks ({', '.join(p['address'] for p in ranks.places)}); {ranks.call('precision')}"
    return JobActors(ranks=ranks, sampler=sampler, where={"opentinker.trainer": trainer, **engine})


def create_selfplay_actor(spec: JobSpec, job_id: str, tenant: str | None = None) -> Any:
    """A self-play job's agents in one actor (on CPU they share the cores anyway)."""
    import ray

    from opentinker.rl.selfplay import SelfPlayJob

    owner = f"{tenant or 'operator'}/{job_id}"
    handle = ray.remote(SelfPlayJob).options(**actor_options(spec, f"{job_id}-agents", owner)).remote(spec, job_id, tenant=tenant)
    ray.get(handle.__ray_ready__.remote())
    return handle
