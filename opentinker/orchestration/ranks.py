"""A job's trainer ranks: Ray actors in one placement group that form one torch.distributed group.

Why: a job wider than one device trains one model on N ranks (opentinker.backend.sharded). Ray
places them: one placement group of N bundles (a GPU each on GPUs, CPUs otherwise), packed on one
node unless the job asks to spread them, so they start together or not at all. Rank 0's actor names
the rendezvous (its node's address and a free port); every rank then joins the process group (NCCL
on GPUs, gloo on CPUs) on the interface of its node's Ray address. Nothing here communicates tensors: FSDP2 and torch.distributed do.

A rank that dies (its process killed, its node lost) fails the whole group's call in one line that
names the rank and its node, as soon as Ray sees it, and the other ranks are killed with it: they
would otherwise wait in a collective until its timeout.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from typing import Any

import torch

from opentinker.core.errors import one_line


def interface_of(address: str) -> str:
    """The network interface that holds `address`. The ranks' gloo (and NCCL's sockets) bind there,
    the address Ray knows the node by, and not where the host name resolves: on a private network
    between machines that may be an address the peers cannot reach, and gloo would bind loopback."""
    import psutil

    for name, addresses in psutil.net_if_addrs().items():
        if any(a.address == address for a in addresses):
            return name
    raise RankFailed(f"no network interface of this node holds its Ray address {address}")


class Rank:
    """One rank, hosted by Ray: its membership of the process group, and the object it hosts (a
    sharded trainer, or a job's `Policy` whose trainer is one), built after the group is joined."""

    def __init__(self, rank: int, world_size: int):
        self.rank, self.world_size = rank, world_size
        self.hosted = None

    def where(self) -> dict[str, Any]:
        """This rank's node address, process id and a free port on its node (rank 0's is the rendezvous)."""
        import ray

        address = ray.util.get_node_ip_address()
        with socket.socket() as s:
            s.bind((address, 0))
            port = s.getsockname()[1]
        return {"address": address, "port": port, "pid": os.getpid(), "node": ray.get_runtime_context().get_node_id()}

    def join(self, address: str, port: int, backend: str, timeout_s: float) -> None:
        import ray

        from opentinker.backend.sharded import init_ranks

        for variable in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):  # the operator's choice stands
            os.environ.setdefault(variable, interface_of(ray.util.get_node_ip_address()))
        init_ranks(self.rank, self.world_size, address, port, backend, timeout_s)

    def host(self, factory: Callable[..., Any], seed: int, args: tuple, kwargs: dict) -> None:
        """Build what this rank hosts; every rank seeds alike first (the same LoRA initialisation)."""
        torch.manual_seed(seed)
        self.hosted = factory(*args, **kwargs)

    def call(self, method: str, *args: Any) -> Any:
        return getattr(self.hosted, method)(*args)


class RankFailed(RuntimeError):
    """A rank of the job's trainer died or raised; the group is gone."""


class RankLost(RankFailed):
    """A rank's process or node went away (killed, out of memory, its node lost): the job resumes from its checkpoint."""


class RankGroup:
    """N `Rank` actors placed together and joined into one process group, each hosting its part."""

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
        self.ranks = [ray.remote(Rank).options(
            num_cpus=cpus_per_rank, num_gpus=gpus_per_rank, max_restarts=0, runtime_env={"env_vars": env},
            scheduling_strategy=PlacementGroupSchedulingStrategy(self.group, placement_group_bundle_index=i),
        ).remote(i, size) for i in range(size)]
        self.places = self.gather("where", [r.where.remote() for r in self.ranks])
        head = self.places[0]
        self.gather("join", [r.join.remote(head["address"], head["port"], "nccl" if gpus_per_rank else "gloo", collective_timeout_s)
                             for r in self.ranks])

    def host(self, factory: Callable[..., Any], *args: Any, seed: int = 0, **kwargs: Any) -> None:
        """Every rank builds `factory(*args, **kwargs)` (the operator's code, never a tenant's) and hosts it."""
        self.gather("host", [r.host.remote(factory, seed, args, kwargs) for r in self.ranks])

    def start(self, method: str, *args: Any) -> list[Any]:
        """The hosted objects' `method(*args)` started on every rank: its ObjectRefs, for `gather`."""
        return [r.call.remote(method, *args) for r in self.ranks]

    def call(self, method: str, *args: Any) -> Any:
        """The hosted objects' `method(*args)` on every rank; rank 0's answer (the ranks agree, or
        only rank 0 holds it: whole weights, a checkpoint's reference)."""
        return self.gather(method, self.start(method, *args))[0]

    def call_ref(self, method: str, *args: Any) -> Any:
        """`call`, its answer left in Ray's object store: rank 0's ObjectRef, once every rank ended well."""
        return self.settle(method, self.start(method, *args))[0]

    def gather(self, method: str, refs: list[Any]) -> list[Any]:
        """Every rank's answer to `method`."""
        import ray

        return ray.get(self.settle(method, refs))

    def settle(self, method: str, refs: list[Any]) -> list[Any]:
        """`refs` once every rank's call ended; the first rank that dies or raises fails the group in one line."""
        import ray

        pending = list(refs)
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            try:
                ray.get(done[0])
            except Exception as err:  # noqa: BLE001 - which rank, where, and why, in one line
                self._fail(method, refs, refs.index(done[0]), err)
        return refs

    def _fail(self, method: str, refs: list[Any], rank: int, err: BaseException) -> None:
        """Raise the group's one line. A rank whose peer died fails too (its collective's connection
        closed), often first: a dead rank, if one shows within a few seconds, is named instead."""
        import ray

        ended, _ = ray.wait(refs, num_returns=len(refs), timeout=5)
        for ref in ended:
            try:
                ray.get(ref)
            except ray.exceptions.RayActorError as died:
                if not getattr(died, "actor_init_failed", False):
                    rank, err = refs.index(ref), died
                    break
            except Exception:  # noqa: BLE001 - another rank's own error: the first one stands
                pass
        place = self.places[rank]["address"] if getattr(self, "places", None) else "its node"
        self.close()
        who = f"trainer rank {rank} of {len(self.ranks)} on {place}"
        if isinstance(err, ray.exceptions.RayActorError) and not getattr(err, "actor_init_failed", False):
            raise RankLost(f"{who} died in {method} (its process was killed or ran out of memory, or its node left)") from err
        raise RankFailed(f"{who} failed in {method}: {one_line(err)}") from err

    def close(self) -> None:
        import ray

        for r in self.ranks:
            ray.kill(r)
        ray.util.remove_placement_group(self.group)
