"""Where a job runs, answered once before it holds a slot: its layout of actors (hosted on the
pool's base-model worker, sharded over ranks, colocated, or split), the engine it samples with, the
spec as it will run (`rollout.engine: auto` chosen, `model.init_from` pinned), and what the cluster
must offer for it, checked now (Ray would wait for ever for resources it lacks).

The job's entry asks this once (`orchestration/job.py`'s `scheduled_job`); `actors.create_actors`
builds what it says, and nothing downstream asks the spec's resources again.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

Kind = Literal["hosted", "sharded", "colocated", "split", "own"]


def streams_apart(spec: Any) -> bool:
    """Does the job's producer play while its trainer updates (max_staleness > 0)? Then the two
    are actors of their own (the split layout), whatever `resources.colocate` says."""
    algorithm = getattr(spec, "algorithm", None)  # an SFT job has none: no producer
    return algorithm is not None and algorithm.max_staleness > 0


@dataclass(frozen=True)
class Layout:
    spec: Any  # the spec as the job runs it (engine chosen, init_from pinned)
    kind: Kind  # "own": a flow that starts its own actor (self-play's agents) or trains where it runs (SFT)
    seat: bool = False  # a seat of the pool's base-model worker instead of the pool's slots
    engine_choice: str | None = None  # how `rollout.engine: auto` was decided, for the job's log


def layout_for(spec: Any, job_id: str, tenant: str | None, on_cluster: bool) -> Layout:
    """The job's layout (see the module). RuntimeError naming the field when the cluster can
    never place it. `on_cluster`: the job joins a cluster (a shared base has a worker there)."""
    from opentinker.core.spec import JobSpec
    from opentinker.rl.engine_choice import choose_engine
    from opentinker.rl.policy import with_pinned_init_from

    seat = bool(spec.resources.share_base) and on_cluster
    if not isinstance(spec, JobSpec) or spec.multiagent is not None:
        kind: Kind = "own"
        choice = None
    else:
        spec, choice = choose_engine(spec, starts_servers=True)  # once: trainer and sampler must agree on how it samples
        r = spec.resources
        kind = ("hosted" if r.share_base else "sharded" if r.trainer_ranks > 1
                else "colocated" if r.colocate and not streams_apart(spec) else "split")
        if kind in ("sharded", "split"):  # the sampler and its server know no tenant: one base for both sides
            spec = with_pinned_init_from(spec, job_id, tenant)
    layout = Layout(spec, kind, seat, choice)
    _check_placeable(layout)
    return layout


def _check_placeable(layout: Layout) -> None:
    """Each of the layout's actors (or the flow's one task) holds the spec's resources; a hosted
    job holds none of its own (the pool's base-model worker was placed when it started)."""
    import ray

    total = ray.cluster_resources()
    r = layout.spec.resources
    actors = {"hosted": 0, "sharded": 1 + r.trainer_ranks, "colocated": 1, "split": 2,
              "own": 0 if r.share_base else 1}[layout.kind]
    need_cpu, need_gpu = r.num_cpus * actors, r.num_gpus * actors
    if need_gpu > total.get("GPU", 0):
        raise RuntimeError(f"resources.num_gpus: the job needs {need_gpu:g} GPU(s), the Ray cluster has {total.get('GPU', 0):g}")
    if need_cpu > total.get("CPU", 0):
        raise RuntimeError(f"resources.num_cpus: the job needs {need_cpu:g} CPU(s), the Ray cluster has {total.get('CPU', 0):g}")
