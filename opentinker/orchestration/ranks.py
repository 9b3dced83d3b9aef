"""A job's trainer ranks: Ray actors in one placement group that form one torch.distributed group.

Why: a job wider than one device trains one model on N ranks (opentinker.backend.sharded). Ray
places them: one placement group of N bundles (a GPU each on GPUs, CPUs otherwise), packed on one
node unless the job asks to spread them, so they start together or not at all. Rank 0's actor names
the rendezvous (its node's address and a free port); every rank then joins the process group (NCCL
on GPUs, gloo on CPUs). Nothing here communicates tensors: FSDP2 and torch.distributed do.

A rank that dies (its process killed, its node lost) fails the whole group's call in one line that
names the rank and its node, as soon as Ray sees it, and the other ranks are killed with it: they
would otherwise wait in a collective until its timeout.
"""

from __future__ import annotations

import os
import socket
from typing import Any

import torch


class TrainerRank:
    """One rank of a sharded trainer, hosted by Ray: its process group membership and its shard."""

    def __init__(self, rank: int, world_size: int):
        self.rank, self.world_size = rank, world_size
        self.trainer = None

    def where(self) -> dict[str, Any]:
        """This rank's node address, process id and a free port on its node (rank 0's is the rendezvous)."""
        import ray

        address = ray.util.get_node_ip_address()
        with socket.socket() as s:
            s.bind((address, 0))
            port = s.getsockname()[1]
        return {"address": address, "port": port, "pid": os.getpid(), "node": ray.get_runtime_context().get_node_id()}

    def join(self, address: str, port: int, backend: str, timeout_s: float) -> None:
        from opentinker.backend.sharded import init_ranks

        init_ranks(self.rank, self.world_size, address, port, backend, timeout_s)

    def build(self, model_name: str, adapter, algorithm, optimization, dtype: str = "float32", seed: int = 0) -> None:
        """This rank's shard of a fresh trainer (every rank loads the same base; FSDP keeps its share)."""
        from opentinker.backend.device import placement
        from opentinker.backend.sharded import ShardedPolicyTrainer
        from opentinker.model.policy import load_model

        torch.manual_seed(seed)  # the same LoRA initialisation on every rank
        model, tokenizer = load_model(model_name)
        where = placement(1 if torch.cuda.is_available() else 0, dtype)
        if where.compute_dtype == torch.float64:
            model = model.double()
        self.trainer = ShardedPolicyTrainer(model, tokenizer, adapter, algorithm, optimization, placement=where)

    def update(self, trajs) -> dict[str, float]:
        return self.trainer.update(trajs)

    def trainable_state(self) -> dict[str, torch.Tensor]:
        return self.trainer.trainable_state()

    def load_trainable_state(self, state: dict[str, torch.Tensor]) -> None:
        self.trainer.load_trainable_state(state)


class RankFailed(RuntimeError):
    """A rank of the job's trainer died or raised; the group is gone."""


class RankGroup:
    """N `TrainerRank` actors placed together and joined into one process group."""

    def __init__(self, size: int, cpus_per_rank: float = 1, gpus_per_rank: float = 0, spread: bool = False,
                 ready_timeout_s: float = 120, collective_timeout_s: float = 60, env_vars: dict[str, str] | None = None):
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        bundle = {"CPU": cpus_per_rank} | ({"GPU": gpus_per_rank} if gpus_per_rank else {})
        self.group = placement_group([bundle] * size, strategy="SPREAD" if spread else "PACK")
        ready, _ = ray.wait([self.group.ready()], timeout=ready_timeout_s)
        if not ready:
            ray.util.remove_placement_group(self.group)
            raise RankFailed(f"the cluster cannot place {size} trainer ranks of {bundle} ({'spread' if spread else 'packed'}) "
                             f"within {ready_timeout_s:g} s; it has {ray.available_resources()}")
        env = {"OMP_NUM_THREADS": str(max(1, int(cpus_per_rank))), "TOKENIZERS_PARALLELISM": "false"} | (env_vars or {})
        self.ranks = [ray.remote(TrainerRank).options(
            num_cpus=cpus_per_rank, num_gpus=gpus_per_rank, max_restarts=0, runtime_env={"env_vars": env},
            scheduling_strategy=PlacementGroupSchedulingStrategy(self.group, placement_group_bundle_index=i),
        ).remote(i, size) for i in range(size)]
        self.places = self._all("where")
        head = self.places[0]
        self._all("join", head["address"], head["port"], "nccl" if gpus_per_rank else "gloo", collective_timeout_s)

    def start(self, method: str, *args: Any) -> list[Any]:
        """`method(*args)` started on every rank: its ObjectRefs, for `gather`."""
        return [getattr(r, method).remote(*args) for r in self.ranks]

    def _all(self, method: str, *args: Any) -> list[Any]:
        return self.gather(method, self.start(method, *args))

    def gather(self, method: str, refs: list[Any]) -> list[Any]:
        """Every rank's answer to `method`; the first rank that dies or raises fails the group in one line."""
        import ray

        pending = list(refs)
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            try:
                ray.get(done[0])
            except Exception as err:  # noqa: BLE001 - which rank, where, and why, in one line
                rank = refs.index(done[0])
                place = self.places[rank]["address"] if getattr(self, "places", None) else "its node"
                self.close()
                raise RankFailed(f"trainer rank {rank} of {len(self.ranks)} on {place} failed in {method}: "
                                 f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}") from err
        return ray.get(refs)

    def call(self, method: str, *args: Any) -> Any:
        """`method(*args)` on every rank; rank 0's answer (the ranks agree, or only rank 0 holds it)."""
        return self._all(method, *args)[0]

    def close(self) -> None:
        import ray

        for r in self.ranks:
            ray.kill(r)
        ray.util.remove_placement_group(self.group)
