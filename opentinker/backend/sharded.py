"""The policy trainer over N ranks of one torch.distributed process group: FSDP2 shards the model.

Why: one process's device bounds a job's model (its weights, gradients and AdamW state, 16 bytes a
trained parameter); N ranks that each hold about 1/N of it train a model N times as large. FSDP2
(`fully_shard` on every decoder layer, then on the root) does all the communication: it gathers a
layer's weights for its forward and backward and reduce-scatters its gradients.

The update equals one rank's update on the same batch, up to summation order:
- every rank gets the whole batch, computes the advantages over whole groups and the loss's
  normaliser over the whole batch, then trains only its share of the groups (`share`);
- FSDP *sums* the ranks' gradients (divide factor 1), so the sum of the shares' gradients, each
  normalised by the whole batch, is the whole batch's gradient; the clip norm is the global one;
- the statistics the update logs are summed over ranks before they are reported.

FSDP's collectives run in every rank's forward and backward, so every rank runs the same number of
passes: a rank with fewer micro-batches (or none) runs the missing ones on a record at weight zero.
Passes are per record, as on a GPU: a shared-prefix update runs a number of passes, in an order,
that depends on each rank's groups, which FSDP's per-layer collectives cannot follow.

Checkpoints: the trained weights are gathered whole on rank 0 (the sampler takes them after every
update anyway; serving, export and `init_from` read them as any job's), while AdamW's state, twice
their size, never leaves its ranks: each writes its share through DCP (storage/shards.py), read
back resharded at any width.

What is sharded: full fine-tuning shards every weight, its gradient and its AdamW moments. A LoRA's
frozen base is sharded too (it is most of the memory) and its adapter weights with it, in the same
FSDP units; the adapter is small, so sharding it costs nothing and keeps one mechanism.
"""

from __future__ import annotations

import datetime
from collections import defaultdict

import torch
import torch.distributed as dist

from opentinker.backend.trainer import AgainstPrefix, PackedBatch, PolicyTrainer, pack, position_logits
from opentinker.core.trajectory import Trajectory


def init_ranks(rank: int, world_size: int, address: str, port: int, backend: str = "gloo", timeout_s: float = 60.0) -> None:
    """Join the job's process group (rank 0's address and port are the rendezvous). A collective
    that waits longer than `timeout_s` for a rank raises instead of waiting for ever."""
    dist.init_process_group(backend, init_method=f"tcp://{address}:{port}", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s))


def shard_units(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules FSDP shards one by one: the transformer's own unsplittable blocks (its decoder layers)."""
    lm = model.get_base_model() if hasattr(model, "get_base_model") else model
    names = set(getattr(lm, "_no_split_modules", None) or ())
    units = [m for m in model.modules() if type(m).__name__ in names]
    if not units:
        raise ValueError(f"{type(lm).__name__} names no decoder layers (_no_split_modules) to shard")
    return units


class Scoring(torch.nn.Module):
    """A model's scoring pass (opentinker.backend.trainer.position_logits) as one module's forward:
    the trainer calls the decoder and then the head, so FSDP's root unit (embeddings, final norm,
    head, tied or not) must be a module whose forward holds both for its gathers and reductions."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, batch: PackedBatch) -> torch.Tensor:
        lm = self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model
        return position_logits(lm, batch)


def shard(model: torch.nn.Module) -> Scoring:
    """FSDP2 over `model`: each decoder layer a unit, the rest (embeddings, norm, head) the root's."""
    from torch.distributed.fsdp import FSDPModule, fully_shard  # here: 0.8 s of imports every job's process would pay

    for unit in shard_units(model):
        fully_shard(unit)
    root = fully_shard(Scoring(model))
    for module in root.modules():  # the ranks' shares are each normalised by the whole batch: sum, don't average
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)  # a plain sum (gloo has no pre-multiplied one)
    return root


def share(trajs: list[Trajectory], rank: int, world_size: int) -> list[int]:
    """The indices of the records rank `rank` trains: whole groups, each to the rank with the fewest
    records so far (the lowest such rank), in the order the groups first appear."""
    groups: dict[int, list[int]] = defaultdict(list)
    for i, t in enumerate(trajs):
        groups[t.group_id].append(i)
    load, mine = [0] * world_size, []
    for members in groups.values():
        to = min(range(world_size), key=lambda r: (load[r], r))
        load[to] += len(members)
        if to == rank:
            mine += members
    return sorted(mine)


class ShardedPolicyTrainer(PolicyTrainer):
    """PolicyTrainer whose model is one rank's FSDP2 shard (the process group is initialised first)."""

    def __init__(self, *args, **kwargs):
        if not dist.is_initialized():
            raise RuntimeError("ShardedPolicyTrainer needs the job's process group (init_ranks) first")
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self._filler: Trajectory | None = None
        super().__init__(*args, **kwargs)

    def _distribute(self) -> None:
        self._scoring = {id(self.model): shard(self.model)}
        if self.reference is not None:
            self._scoring[id(self.reference)] = shard(self.reference)

    def _token_logits(self, model, batch: PackedBatch, prefix: AgainstPrefix | None = None) -> torch.Tensor:
        assert prefix is None, "a sharded update scores whole records"
        with self.placement.autocast():
            logits = self._scoring[id(model)](batch)
        return logits.to(self.placement.weights_dtype(trained=True)) / self.temperature

    def shares_prefixes(self) -> bool:
        return False

    def _accumulate(self, trajs: list[Trajectory], advantages: torch.Tensor, normalizer: float) -> dict[str, float]:
        mine = share(trajs, self.rank, self.world_size)
        self._filler = trajs[0]
        return super()._accumulate([trajs[i] for i in mine], advantages[mine], normalizer)

    def _per_record_passes(self, trajs: list[Trajectory], advantages: torch.Tensor, normalizer: float, sums: dict[str, float]) -> None:
        passes = torch.tensor(len(self._micro_batches(trajs)))
        most = passes.clone()
        dist.all_reduce(most, op=dist.ReduceOp.MAX)  # before any pass: each pass is FSDP's collectives
        super()._per_record_passes(trajs, advantages, normalizer, sums)
        filler = pack([self._filler], self.pad_id).to(self.placement.device)
        for _ in range(int(most - passes)):  # FSDP's collectives need the same passes on every rank
            zero = torch.zeros(1, device=self.placement.device)
            (self._loss(filler, zero, normalizer, defaultdict(float)) * 0.0).backward()

    def _sum_over_ranks(self, sums: dict[str, float]) -> None:
        keys = sorted(sums)
        total = torch.tensor([sums[k] for k in keys], dtype=torch.float64)
        dist.all_reduce(total)
        sums.update(zip(keys, total.tolist()))

    def _clip_gradients(self) -> float:
        from torch.distributed.tensor import DTensor

        norm = torch.nn.utils.clip_grad_norm_(self.params, self.optim_spec.grad_clip)
        return float(norm.full_tensor() if isinstance(norm, DTensor) else norm)

    # -- state: whole tensors for checkpoints and samplers (every rank calls; the CPU copy is rank 0's) --
    def trainable_state(self) -> dict[str, torch.Tensor]:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        whole = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        trained = {n for n, p in self.model.named_parameters() if p.requires_grad}
        return {n: t for n, t in whole.items() if n in trained}

    def write_optimizer_state(self, url: str) -> dict[str, tuple[int, str]] | None:
        """Every rank writes its share of AdamW's state into the checkpoint folder `url` (rank 0
        clears it first); rank 0 gets every rank's files (for COMMIT.json), the others None."""
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        from opentinker.storage.checkpoint import OPTIMIZER_SHARDS
        from opentinker.storage.committed import clear
        from opentinker.storage.shards import write_share

        if self.rank == 0:
            clear(url)
        dist.barrier()
        mine = write_share(url, OPTIMIZER_SHARDS, {"state": get_optimizer_state_dict(self.model, self.optimizer)["state"]})
        everyone: list = [None] * self.world_size
        dist.all_gather_object(everyone, mine)  # between the job's own ranks (the operator's code)
        return {name: file for files in everyone for name, file in files.items()} if self.rank == 0 else None

    def load_optimizer_state(self, state) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        from opentinker.storage.shards import Shards

        if isinstance(state, Shards):
            return state.load_optimizer(self.model, self.optimizer)
        set_optimizer_state_dict(self.model, self.optimizer, state, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))

    def load_trainable_state(self, state: dict[str, torch.Tensor]) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        trained = [n for n, p in self.model.named_parameters() if p.requires_grad]
        if self.rank == 0 and (missing := [n for n in trained if n not in state]):
            raise ValueError(f"checkpoint lacks {len(missing)} trainable tensors, e.g. {missing[0]}")
        set_model_state_dict(self.model, state, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=False))


def sharded_trainer(model_name: str, adapter, algorithm, optimization, dtype: str = "float32", **kwargs) -> ShardedPolicyTrainer:
    """This rank's shard of a fresh trainer on `model_name` (every rank loads the whole base, FSDP
    keeps its share); `dtype` float64 is the tests' exact reference."""
    from opentinker.backend.device import placement
    from opentinker.model.policy import load_model

    model, tokenizer = load_model(model_name)
    where = placement(1 if torch.cuda.is_available() else 0, dtype)
    if where.compute_dtype == torch.float64:
        model = model.double()
    return ShardedPolicyTrainer(model, tokenizer, adapter, algorithm, optimization, placement=where, **kwargs)
