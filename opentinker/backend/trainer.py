"""The policy trainer: transformers + peft, LoRA or full, AdamW with gradient accumulation.

It scores the token records the agent loop wrote (never re-tokenizing), computes advantages and
the clipped policy loss, and counts policy versions so that stale rollouts are refused. By default
(`optimization.shared_prefix`) a group's common prompt runs once and its samples' completions
against it (opentinker.backend.shared_prefix), with the same loss and gradients as scoring every
record on its own, which is what the trainer does with the flag off or for vision-language models.
"""

from __future__ import annotations

import time
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch

from opentinker.algo import entropy_from_logits, ppo_clipped_loss
from opentinker.algo.turn_credit import credit
from opentinker.backend.adapter_model import AdapterModel
from opentinker.backend.shared_prefix import PACK_TOKENS, Prefix, plan, run_prefix, selected_hidden, supports
from opentinker.backend.device import Placement, cpu
from opentinker.backend.regional_compile import compile_regions
from opentinker.core.spec import AlgorithmSpec, FullSpec, LoraSpec, OptimizationSpec
from opentinker.core.spec_limits import SHARED_PASS_TOKENS
from opentinker.core.trajectory import Trajectory
from opentinker.model.adapters import autocast_lora_inputs, wrap_model
from opentinker.model.vision import hidden_states, pixel_batch


@dataclass
class AgainstPrefix:
    """A micro-batch scored against shared prefixes: record b continues the prefix of group `slots[b]`."""

    prefix: Prefix
    slots: torch.Tensor


class StalePolicyError(RuntimeError):
    """A rollout sampled from a policy older than the configured off-policy allowance."""


@dataclass
class PackedBatch:
    """Right-padded tensors for a list of trajectories; targets are shifted by one."""

    input_ids: torch.Tensor  # [B, L]
    attention_mask: torch.Tensor  # [B, L]
    targets: torch.Tensor  # [B, L-1]: token t+1 predicted at position t
    loss_mask: torch.Tensor  # [B, L-1]
    old_logprobs: torch.Tensor  # [B, L-1]: the sampler's (on-policy the ratio's denominator, off-policy the importance weight's)
    pixels: dict[str, torch.Tensor] = field(default_factory=dict)  # a VLM's: pixel_values, pixel_attention_mask

    def to(self, device: torch.device) -> PackedBatch:
        tensors = (t.to(device) for t in (self.input_ids, self.attention_mask, self.targets, self.loss_mask, self.old_logprobs))
        return PackedBatch(*tensors, {k: v.to(device) for k, v in self.pixels.items()})


def pack(trajs: list[Trajectory], pad_id: int) -> PackedBatch:
    width = max(len(t) for t in trajs)
    ids = torch.full((len(trajs), width), pad_id, dtype=torch.long)
    attn = torch.zeros((len(trajs), width), dtype=torch.long)
    mask = torch.zeros((len(trajs), width), dtype=torch.float32)
    old = torch.zeros((len(trajs), width), dtype=torch.float32)
    for row, t in enumerate(trajs):
        n = len(t)
        ids[row, :n] = torch.tensor(t.token_ids)
        attn[row, :n] = 1
        mask[row, :n] = torch.tensor(t.loss_mask, dtype=torch.float32)
        old[row, :n] = torch.tensor(t.sampling_logprobs, dtype=torch.float32)
    pixels = pixel_batch([t.images for t in trajs], "cpu") if any(t.images for t in trajs) else {}
    return PackedBatch(ids, attn, ids[:, 1:], mask[:, 1:], old[:, 1:], pixels)


def param_groups(model, trained: list, lr: float, vision_lr: float | None) -> list[dict]:
    """The optimizer's groups: everything at `lr`, or, with `vision_lr`, a VLM's trained vision side
    (connector, encoder) in a group of its own at that rate (LLaVA-style: a fresh projection wants
    a larger step than the LoRA on a pretrained language model)."""
    from opentinker.model.vision import connector_parameters, encoder_parameters

    vision = {id(p) for p in encoder_parameters(model) + connector_parameters(model)} if vision_lr is not None else set()
    groups = [{"params": [p for p in trained if id(p) not in vision], "lr": lr},
              {"params": [p for p in trained if id(p) in vision], "lr": vision_lr}]
    return [g for g in groups if g["params"]]


def position_logits(lm, batch: PackedBatch, prefix: AgainstPrefix | None = None) -> torch.Tensor:
    """The causal LM's logits at the positions whose next token is trainable, [N, V]."""
    if prefix is None:
        hidden = hidden_states(lm, batch.input_ids, batch.attention_mask, **batch.pixels)
        selected = hidden[:, :-1][batch.loss_mask.bool()]
    else:
        selected = selected_hidden(lm, prefix.prefix, prefix.slots, batch.input_ids, batch.attention_mask, batch.loss_mask)
    return lm.get_output_embeddings()(selected)


class PolicyTrainer:
    """Holds the policy, its optimizer and (for KL) the reference; one `update` per RL step."""

    rank = 0  # which rank of a sharded trainer (opentinker.backend.sharded) this is; the one that writes files

    def __init__(self, model, tokenizer, adapter: LoraSpec | FullSpec, algorithm: AlgorithmSpec, optim: OptimizationSpec,
                 temperature: float = 1.0, placement: Placement | None = None, sampled_apart: bool = False):
        self.is_lora = isinstance(adapter, LoraSpec)
        self.placement = placement or cpu()
        if isinstance(model, AdapterModel):  # an adapter of a shared base (a base-model worker's): adapted and placed there
            self.model = model
        else:
            if self.is_lora:  # the frozen base in the compute precision; peft keeps the adapter in float32
                model = model.to(dtype=self.placement.weights_dtype(trained=False))
            self.model = wrap_model(model, adapter).to(self.placement.device)
            autocast_lora_inputs(self.model, self.placement.compute_dtype)
            if optim.compile:
                compile_regions(self.model)
        trained_dtype = self.placement.weights_dtype(trained=True)
        for p in self.model.parameters():  # what trains is float32 (a VLM's vision tower may have come in the compute precision)
            if p.requires_grad and p.dtype != trained_dtype:
                p.data = p.data.to(trained_dtype)
        self.tokenizer = tokenizer
        self.algorithm = algorithm
        self.sampled_apart = sampled_apart  # another engine samples, its logprobs not this trainer's (reduced precision)
        self.optim_spec = optim
        self.temperature = temperature
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.version = 0
        self.critic = None  # advantage gae's value model (backend/critic.py), given by the trainer's owner
        self.pack_tokens = PACK_TOKENS  # most tokens of a shared-prefix pass (bench/gpu_variants.py tries others)
        # A job on a shared base: each pass at most this many padded tokens, whatever its micro-batch size
        self.pass_tokens = SHARED_PASS_TOKENS if isinstance(model, AdapterModel) else None
        # A hosted job whose per-sequence micro-batches join other jobs' passes: the base's
        # `joint_update(name)` (opentinker.backend.shared_base), set by its worker; None: its own passes
        self.joint = None
        self.reference = None
        if algorithm.kl.coef > 0 and not self.is_lora:
            # Full fine-tuning needs a frozen copy; LoRA uses the base with the adapter disabled.
            import copy

            self.reference = copy.deepcopy(self.model).eval().requires_grad_(False)
        self._distribute()
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(param_groups(self._causal_lm(self.model), self.params, optim.lr, adapter.vision_lr),
                                           lr=optim.lr, weight_decay=optim.weight_decay)

    def _distribute(self) -> None:
        """Where the model's state is split over ranks (opentinker.backend.sharded); one process holds it whole."""

    # -- scoring ---------------------------------------------------------------------------
    def _causal_lm(self, model):
        return model.get_base_model() if hasattr(model, "get_base_model") else model

    def _token_logits(self, model, batch: PackedBatch, prefix: AgainstPrefix | None = None) -> torch.Tensor:
        """Logits at the positions whose next token is trainable, [N, V] (the lm head runs only there).
        With `prefix`, each record starts with its group's shared prefix and only what follows runs."""
        with self.placement.autocast():
            logits = position_logits(self._causal_lm(model), batch, prefix)
        return logits.to(self.placement.weights_dtype(trained=True)) / self.temperature

    def _scatter(self, values: torch.Tensor, batch: PackedBatch) -> torch.Tensor:
        out = torch.zeros(batch.loss_mask.shape, dtype=values.dtype, device=values.device)
        out[batch.loss_mask.bool()] = values
        return out

    def _logprobs(self, model, batch: PackedBatch, with_entropy: bool = False, prefix: AgainstPrefix | None = None):
        return self._logprobs_of(self._token_logits(model, batch, prefix), batch, with_entropy)

    def _logprobs_of(self, logits: torch.Tensor, batch: PackedBatch, with_entropy: bool = False):
        """[B, L-1] logprobs of the targets (and the entropies) from the logits at the loss positions."""
        targets = batch.targets[batch.loss_mask.bool()]
        lp = torch.log_softmax(logits, dim=-1).gather(-1, targets[:, None]).squeeze(-1)
        entropy = entropy_from_logits(logits.detach()) if with_entropy else None
        return self._scatter(lp, batch), entropy

    @torch.no_grad()
    def logprobs(self, trajs: list[Trajectory]) -> list[list[float]]:
        """Recomputed logprobs of each trajectory's sampled tokens, in record order (for checks)."""
        self.model.eval()
        batch = pack(trajs, self.pad_id).to(self.placement.device)
        lp, _ = self._logprobs(self.model, batch)
        return [lp[i][batch.loss_mask[i].bool()].tolist() for i in range(len(trajs))]

    def _reference(self):
        """The reference policy for KL, and the context it is scored in."""
        if self.reference is not None:
            return self.reference, nullcontext()
        return self.model, self.model.disable_adapter()  # LoRA: the base with the adapter off

    @torch.no_grad()
    def _reference_logprobs(self, batch: PackedBatch, prefix: AgainstPrefix | None = None) -> torch.Tensor:
        model, scope = self._reference()
        with scope:
            return self._logprobs(model, batch, prefix=prefix)[0]

    @torch.no_grad()
    def _reference_prefix(self, ids: list[torch.Tensor]) -> Prefix:
        model, scope = self._reference()
        with scope, self.placement.autocast():
            return run_prefix(self._causal_lm(model), ids)

    @property
    def off_policy(self) -> bool:
        """Does the loss correct for tokens drawn by another policy than the one it scores: older
        versions (max_staleness > 0), or the same weights through another engine in a reduced
        precision (vLLM in bfloat16, under a float32 or a bfloat16 trainer)? Then the sampler's logprobs are the behaviour policy's, and the
        trainer's own, before its step, the proximal policy's (decoupled PPO)."""
        return self.algorithm.max_staleness > 0 or self.sampled_apart

    def shares_prefixes(self) -> bool:
        """Does `update` score groups against their shared prefix (the flag on, a model that can)?
        `auto`: on the CPU only. On a GPU the packs of a shared-prefix pass (dense 4-D masks, a few
        thousand tokens) keep the device far less busy than whole records in large micro-batches:
        an H200 ran the 1.5B shape's update 1.8x faster per sequence (3.6x for LoRA)."""
        flag = self.optim_spec.shared_prefix
        if flag == "auto":
            flag = self.placement.device.type == "cpu"
        return flag and supports(self._causal_lm(self.model))

    # -- update ----------------------------------------------------------------------------
    def check_fresh(self, rollout_version: int) -> None:
        lag = self.version - rollout_version
        if lag > self.algorithm.max_staleness:
            raise StalePolicyError(
                f"rollout sampled from policy version {rollout_version}, trainer is at {self.version} "
                f"(lag {lag} > algorithm.max_staleness={self.algorithm.max_staleness})"
            )

    def update(self, trajs: list[Trajectory]) -> dict[str, float]:
        """One optimizer step on a batch of trajectories (gradients accumulated over micro-batches)."""
        t0 = time.perf_counter()
        # Only samples that enter the loss must be fresh: a failed episode (e.g. its environment
        # was down before any token was sampled) carries no policy version worth checking.
        usable = [t for t in trajs if not t.failed and t.num_sampled > 0]
        for t in usable:
            self.check_fresh(t.policy_version)
        metrics: dict[str, float] = {"update/sequences": float(len(usable))}
        if not usable:
            self.version += 1
            return metrics | {"update/skipped": 1.0}
        metrics |= self.compute_gradients(usable)
        grad_norm = self._clip_gradients()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.version += 1
        return metrics | {"update/grad_norm": float(grad_norm), "update/seconds": time.perf_counter() - t0}

    def _clip_gradients(self) -> float:
        """Clips the gradients' global norm to `grad_clip`; returns the norm before clipping."""
        return float(torch.nn.utils.clip_grad_norm_(self.params, self.optim_spec.grad_clip))

    def compute_gradients(self, trajs: list[Trajectory]) -> dict[str, float]:
        """The loss's gradient over `trajs` (records with sampled tokens) in each trainable
        parameter's `.grad`, accumulated over micro-batches; returns the loss's statistics.

        update/positions_computed: token positions the policy's forward and backward ran over,
        padding included (the reference's forward for KL is not counted); update/positions_trained:
        the positions whose token carries loss."""
        trajs, advantages = credit(trajs, self.algorithm, self.critic)  # whole records, or a sample per turn (algo.turn_credit)
        advantages = advantages.to(self.placement.device)
        normalizer = float(sum(t.num_sampled for t in trajs)) if self.algorithm.loss_aggregation == "token-mean" else float(len(trajs))
        return self._accumulate(trajs, advantages, normalizer) | {"update/advantage_abs_mean": float(advantages.abs().mean())}

    def _accumulate(self, trajs: list[Trajectory], advantages: torch.Tensor, normalizer: float) -> dict[str, float]:
        """The gradient of the loss over `trajs` (their `advantages`, the whole batch's `normalizer`)."""
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        sums = dict.fromkeys(("pg_loss", "kl", "clip_fraction", "ratio", "entropy", "tokens", "computed", "passes", "joint", "weight", "capped",
                              "sampler_gap"), 0.0)
        shared = self.shares_prefixes()
        joint = self.joint if self.joint is not None and not shared else None
        try:
            if shared:
                self._shared_prefix_pass(trajs, advantages, normalizer, sums)
            elif joint is not None:
                self._joint_passes(joint, trajs, advantages, normalizer, sums)
            else:
                self._per_record_passes(trajs, advantages, normalizer, sums)
        finally:  # sampling runs in eval mode (a hosted adapter's dropout is off again even when a pass raised)
            self.model.eval()
        self._sum_over_ranks(sums)
        n_tokens = max(sums["tokens"], 1.0)
        shares = {"update/joint_passes": sums["passes"], "update/joint_share": sums["joint"] / sums["passes"]} if sums["passes"] else {}
        return shares | {
            "update/policy_loss": sums["pg_loss"],
            "update/kl": sums["kl"],
            "update/entropy": sums["entropy"] / n_tokens,
            "update/clip_fraction": sums["clip_fraction"] / n_tokens,
            "update/ratio_mean": sums["ratio"] / n_tokens,
            "update/tokens": sums["tokens"],
            "update/positions_computed": sums["computed"],
            "update/positions_trained": sums["tokens"],
            "update/shared_prefix": float(shared),
        } | ({"update/behaviour_weight_mean": sums["weight"] / n_tokens, "update/behaviour_weight_capped": sums["capped"] / n_tokens,
              # mean |log pi_trainer - log pi_sampler| of the trained tokens: how far the sampler's numbers are from ours
              "update/sampler_logprob_gap": sums["sampler_gap"] / n_tokens} if self.off_policy else {})

    def _per_record_passes(self, trajs: list[Trajectory], advantages: torch.Tensor, normalizer: float, sums: dict[str, float]) -> None:
        for start, end in self._micro_batches(trajs):
            batch = pack(trajs[start:end], self.pad_id).to(self.placement.device)
            self._loss(batch, advantages[start:end], normalizer, sums).backward()
            sums["computed"] += batch.input_ids.numel()

    def _sum_over_ranks(self, sums: dict[str, float]) -> None:
        """The statistics of every rank's share added up (one process: they are already whole)."""

    def _micro_batches(self, trajs: list[Trajectory]) -> list[tuple[int, int]]:
        """Consecutive (start, end) runs of at most `micro_batch_size` records and, with a pass
        bound, at most `pass_tokens` padded positions (a longer record runs alone)."""
        mb, budget, runs, start = self.optim_spec.micro_batch_size, self.pass_tokens, [], 0
        while start < len(trajs):
            end, width = start + 1, len(trajs[start])
            while end < len(trajs) and end - start < mb and (budget is None or max(width, len(trajs[end])) * (end - start + 1) <= budget):
                width, end = max(width, len(trajs[end])), end + 1
            runs.append((start, end))
            start = end
        return runs

    def _shared_prefix_pass(self, trajs: list[Trajectory], advantages: torch.Tensor, normalizer: float, sums: dict[str, float]) -> None:
        """Each group's shared prefix runs once (with gradients), the completions of its records
        against it; small groups are packed together. One backward per pack, or per row of a large
        group's completions with the prefix's own backward once (opentinker.backend.shared_prefix)."""
        device = self.placement.device
        lm = self._causal_lm(self.model)
        for work in plan([t.token_ids for t in trajs], [t.group_id for t in trajs], self.optim_spec.micro_batch_size, self.pack_tokens):
            ids = [torch.tensor(trajs[g[0]].token_ids[:n], dtype=torch.long, device=device) for g, n in zip(work.groups, work.prefix_lengths)]
            with self.placement.autocast():
                prefix = run_prefix(lm, ids)
            ref_prefix = self._reference_prefix(ids) if self.algorithm.kl.coef > 0 else None
            feed = prefix if len(work.rows) == 1 else prefix.detached()
            sums["computed"] += sum(work.prefix_lengths)
            for row in work.rows:
                batch = pack([trajs[i] for i in row], self.pad_id).to(device)
                slots = torch.tensor([work.slot(i) for i in row], device=device)
                ref = AgainstPrefix(ref_prefix, slots) if ref_prefix is not None else None
                self._loss(batch, advantages[row], normalizer, sums, AgainstPrefix(feed, slots), ref).backward()
                sums["computed"] += float(batch.attention_mask.sum() - sum(work.prefix_lengths[s] for s in slots.tolist()))
            if feed is not prefix:
                prefix.backward_from(feed)

    def _joint_passes(self, joint, trajs: list[Trajectory], advantages: torch.Tensor, normalizer: float, sums: dict[str, float]) -> None:
        """The per-sequence micro-batches, each run by the shared base's runner, in one pass with
        other hosted jobs' micro-batches that come with it (the same loss and gradient as alone)."""
        kl = self.algorithm.kl
        with joint() as run:
            for start, end in self._micro_batches(trajs):
                batch = pack(trajs[start:end], self.pad_id).to(self.placement.device)
                ref = self._reference_logprobs(batch) if kl.coef > 0 else None  # the base alone, here

                def loss(logits: torch.Tensor, batch=batch, part=advantages[start:end], ref=ref) -> tuple[torch.Tensor, dict[str, float]]:
                    return self._loss_of(self._logprobs_of(logits.float() / self.temperature, batch, True), batch, part, normalizer, ref)

                adapters, stats = run(batch.input_ids, batch.attention_mask, batch.loss_mask, loss)
                for key, value in stats.items():
                    sums[key] += value
                sums["passes"] += 1
                sums["joint"] += float(adapters > 1)
                sums["computed"] += batch.input_ids.numel()

    def _loss(self, batch: PackedBatch, advantages: torch.Tensor, normalizer: float, sums: dict[str, float],
              prefix: AgainstPrefix | None = None, ref_prefix: AgainstPrefix | None = None) -> torch.Tensor:
        """The clipped policy loss (plus KL) of one micro-batch, its statistics added to `sums`."""
        ref = self._reference_logprobs(batch, ref_prefix) if self.algorithm.kl.coef > 0 else None
        loss, stats = self._loss_of(self._logprobs(self.model, batch, with_entropy=True, prefix=prefix), batch, advantages, normalizer, ref)
        for key, value in stats.items():
            sums[key] += value
        return loss

    def _loss_of(self, scored, batch: PackedBatch, advantages: torch.Tensor, normalizer: float,
                 ref: torch.Tensor | None) -> tuple[torch.Tensor, dict[str, float]]:
        """The clipped policy loss (plus KL) of a micro-batch from its (logprobs, entropies), and its statistics."""
        lp, entropy = scored
        kl = self.algorithm.kl
        # Off-policy, the ratio's denominator is the proximal policy (decoupled PPO): the weights as
        # they are before this update's one optimizer step, which are the weights every pass of the
        # update runs on, so this pass's own logprobs (without gradient) are exactly its logprobs.
        old, behaviour = (lp.detach(), batch.old_logprobs) if self.off_policy else (batch.old_logprobs, None)
        out = ppo_clipped_loss(
            lp, old, advantages, batch.loss_mask, clip_range=self.algorithm.clip_range,
            aggregation=self.algorithm.loss_aggregation, ref_logprobs=ref, kl_coef=kl.coef, kl_estimator=kl.estimator,
            normalizer=normalizer, behaviour_logprobs=behaviour, weight_cap=self.algorithm.importance_cap,
        )
        tokens = float(batch.loss_mask.sum())
        return out.loss, {"tokens": tokens, "pg_loss": float(out.pg_loss), "kl": float(out.kl),
                          "clip_fraction": float(out.clip_fraction) * tokens, "ratio": float(out.ratio_mean) * tokens,
                          "entropy": float(entropy.sum()), "weight": float(out.weight_mean) * tokens,
                          "capped": float(out.capped_fraction) * tokens,
                          "sampler_gap": float(((old - batch.old_logprobs).abs() * batch.loss_mask).sum()) if self.off_policy else 0.0}

    # -- state (for checkpoints and weight sync) -------------------------------------------
    def optimizer_state(self) -> dict:
        return self.optimizer.state_dict()

    def load_optimizer_state(self, state) -> None:
        """`state`: this trainer's own (a dict), or a sharded job's shares (storage.shards.Shards): one process resumes it too."""
        from opentinker.storage.shards import Shards

        if isinstance(state, Shards):
            return state.load_optimizer(self.model, self.optimizer)
        self.optimizer.load_state_dict(state)

    def trainable_state(self) -> dict[str, torch.Tensor]:
        """The trained weights, copied to the CPU (for checkpoints and for samplers elsewhere)."""
        return {n: p.detach().to("cpu", copy=True) for n, p in self.model.named_parameters() if p.requires_grad}

    def load_trainable_state(self, state: dict[str, torch.Tensor]) -> None:
        named = dict(self.model.named_parameters())
        missing = [n for n, p in named.items() if p.requires_grad and n not in state]
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} trainable tensors, e.g. {missing[0]}")
        with torch.no_grad():
            for n, t in state.items():
                named[n].copy_(t)
