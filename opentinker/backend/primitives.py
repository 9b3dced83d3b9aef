"""Training primitives on token data: forward, forward-backward with a named loss, optimizer step.

This is the trainer the Tinker API's training clients drive: a LoRA (rank, seed, which of
attention / MLP / unembedding train) on a frozen base; `forward_backward` adds the gradient of a
loss from `opentinker.algo.primitive_losses` to what earlier calls left (nothing happens to the
weights), `optim_step` applies AdamW with the parameters the caller sends (learning rate, betas,
eps, decoupled weight decay, gradient clipping) and clears the gradients. Every datum is scored
at every position: position t predicts `target_tokens[t]` (the client sends inputs and targets
already shifted), and its log-probability comes back per datum.
"""

from __future__ import annotations

import io
import json
import math
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch

from opentinker.algo.primitive_losses import LOSSES, loss_config, primitive_loss
from opentinker.backend.device import Placement, cpu
from opentinker.core.spec import LoraSpec
from opentinker.model.adapters import adapter_files, autocast_lora_inputs, wrap_model
from opentinker.model.vision import hidden_states

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]
UNEMBED = ["lm_head"]
LORA_ALPHA = 32.0  # not on the wire; Tinker's default
MICRO_BATCH_TOKENS = 4096  # padded positions per forward pass
MAX_SOFT_TARGETS = 256  # K of cross_entropy's [N, K] soft targets


class BadRequest(ValueError):
    """Input the caller got wrong; the message names the datum and the field."""


@dataclass(frozen=True)
class LoraShape:
    """A training client's LoRA as the SDK configures it."""

    rank: int = 32
    seed: int | None = None
    train_attn: bool = True
    train_mlp: bool = True
    train_unembed: bool = True

    def spec(self) -> LoraSpec:
        modules = ATTENTION * self.train_attn + MLP * self.train_mlp + UNEMBED * self.train_unembed
        if not modules:
            raise BadRequest("lora_config: train_attn, train_mlp and train_unembed are all false: nothing would train")
        if not 1 <= self.rank <= 512:
            raise BadRequest(f"lora_config.rank: {self.rank} (1 to 512)")
        return LoraSpec(r=self.rank, alpha=LORA_ALPHA, dropout=0.0, target_modules=modules)


@dataclass(frozen=True)
class AdamParams:
    learning_rate: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0

    def check(self) -> None:
        values = asdict(self)
        bad = [k for k, v in values.items() if not math.isfinite(v) or v < 0]
        if bad or not (self.beta1 < 1 and self.beta2 < 1) or self.eps <= 0:
            raise BadRequest(f"adam_params: {', '.join(bad) or 'beta1/beta2 must be < 1 and eps > 0'}: {values}")


def _as_float(name: str, i: int, array: np.ndarray, shape: tuple[int, ...]) -> torch.Tensor:
    if tuple(array.shape) != shape:
        raise BadRequest(f"data[{i}].loss_fn_inputs[{name!r}]: shape {list(array.shape)}, expected {list(shape)} (the target_tokens' shape)")
    tensor = torch.as_tensor(np.array(array, dtype=np.float32))
    if not bool(torch.isfinite(tensor).all()):
        raise BadRequest(f"data[{i}].loss_fn_inputs[{name!r}]: holds NaN or infinity")
    return tensor


def checked_rows(data: list[Any], loss_fn: str, vocab_size: int, context_length: int | None, base_name: str
                 ) -> list[dict[str, torch.Tensor]]:
    """Each datum as tensors (tokens, target_tokens and the loss's inputs), or BadRequest naming the datum and field.

    `target_tokens` is [N], or [N, K] for cross_entropy's soft targets (K candidate tokens per
    position, `weights` [N, K] too: off-policy distillation's teacher top-K and their probabilities).
    gspo's optional `sequence_ratio_mask` [N] defaults to the positions with a nonzero advantage."""
    if not data:
        raise BadRequest("data: empty (one datum at least)")
    needed = ("target_tokens", *LOSSES[loss_fn][0])
    rows = []
    for i, datum in enumerate(data):
        n = len(datum.tokens)
        if n == 0:
            raise BadRequest(f"data[{i}].model_input: no tokens")
        if context_length and n > context_length:
            raise BadRequest(f"data[{i}].model_input: {n} tokens, the model's context is {context_length}")
        missing = [k for k in needed if k not in datum.inputs and not (k == "weights" and loss_fn == "cross_entropy")]
        if missing:
            raise BadRequest(f"data[{i}].loss_fn_inputs: {loss_fn} needs {', '.join(missing)}")
        tokens = torch.as_tensor(datum.tokens, dtype=torch.long)
        targets = datum.inputs["target_tokens"]
        if targets.ndim not in (1, 2) or targets.shape[0] != n:
            raise BadRequest(f"data[{i}].loss_fn_inputs['target_tokens']: shape {list(targets.shape)}, the model input has {n} tokens")
        if targets.ndim == 2 and loss_fn != "cross_entropy":
            raise BadRequest(f"data[{i}].loss_fn_inputs['target_tokens']: shape {list(targets.shape)}: soft targets [N, K] "
                             f"are taken by cross_entropy only, not {loss_fn}")
        if targets.ndim == 2 and not 1 <= targets.shape[1] <= MAX_SOFT_TARGETS:
            raise BadRequest(f"data[{i}].loss_fn_inputs['target_tokens']: {targets.shape[1]} targets per position (1 to {MAX_SOFT_TARGETS})")
        targets = torch.as_tensor(np.array(targets, dtype=np.int64))
        for name, ids in (("model_input", tokens), ("target_tokens", targets)):
            if bool(((ids < 0) | (ids >= vocab_size)).any()):
                raise BadRequest(f"data[{i}].{name}: token ids must be in [0, {vocab_size}) for {base_name}")
        row = {"tokens": tokens, "target_tokens": targets}
        for name in LOSSES[loss_fn][0]:
            shape = tuple(targets.shape) if name == "weights" else (n,)
            row[name] = _as_float(name, i, datum.inputs[name], shape) if name in datum.inputs else torch.zeros(shape)
        if loss_fn == "gspo":
            mask = datum.inputs.get("sequence_ratio_mask")
            row["sequence_ratio_mask"] = (_as_float("sequence_ratio_mask", i, mask, (n,)) if mask is not None
                                          else (row["advantages"] != 0).float())
        rows.append(row)
    return rows


def micro_batches(lengths: list[int], budget: int = MICRO_BATCH_TOKENS) -> list[list[int]]:
    """Indices grouped (shortest first) so that no group pads to more than `budget` positions."""
    batches, current, width = [], [], 0
    for i in sorted(range(len(lengths)), key=lambda i: lengths[i]):
        n = lengths[i]
        if current and max(width, n) * (len(current) + 1) > budget:
            batches.append(current)
            current, width = [], 0
        current.append(i)
        width = max(width, n)
    return batches + [current] if current else batches


SLOTTED = ("target_tokens", "weights")  # the keys that take a slot dimension with soft targets


def padded(rows: list[dict[str, torch.Tensor]], device: Any) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Rows right-padded to one width ([B, T] per key, zeros where a row lacks a key) and the mask
    of real positions. When a row has soft targets ([N, K]), every row's `target_tokens` and
    `weights` become [B, T, K] (K the widest; a hard target sits in slot 0, the other slots weigh 0)."""
    width = max(len(r["tokens"]) for r in rows)
    k = max((r["target_tokens"].shape[1] for r in rows if "target_tokens" in r and r["target_tokens"].dim() == 2), default=0)
    dtypes = {key: v.dtype for r in rows for key, v in r.items()}
    out = {key: torch.zeros((len(rows), width, k) if k and key in SLOTTED else (len(rows), width), dtype=dtype)
           for key, dtype in dtypes.items()}
    mask = torch.zeros((len(rows), width))
    for b, row in enumerate(rows):
        n = len(row["tokens"])
        for key, v in row.items():
            if k and key in SLOTTED:
                v = v[:, None] if v.dim() == 1 else v
                out[key][b, :n, : v.shape[1]] = v
            else:
                out[key][b, :n] = v
        mask[b, :n] = 1.0
    return {key: v.to(device) for key, v in out.items()}, mask.to(device)


def row_logprobs(values: np.ndarray, r: int, row: dict[str, torch.Tensor]) -> np.ndarray:
    """Row r's log p(target) from a padded pass's [B, T] or [B, T, K] values, in its own target_tokens' shape."""
    targets = row["target_tokens"]
    n = targets.shape[0]
    if values.ndim == 2:
        return values[r, :n].astype(np.float32)
    return (values[r, :n, 0] if targets.dim() == 1 else values[r, :n, : targets.shape[1]]).astype(np.float32)


def graded_positions(padded_rows: dict[str, torch.Tensor], mask: torch.Tensor, loss_fn: str, config: dict[str, float],
                     forward_only: bool) -> torch.Tensor:
    """Where the loss has a gradient: weights (cross-entropy) or advantages nonzero, every real
    position for dro with beta > 0 (or when nothing trains)."""
    if forward_only or loss_fn == "dro" and config.get("beta", 0) > 0:
        return mask.bool()
    coefficient = padded_rows.get("weights") if loss_fn == "cross_entropy" else padded_rows.get("advantages")
    nonzero = coefficient != 0
    return mask.bool() & (nonzero.any(-1) if nonzero.dim() == 3 else nonzero)


def add_metrics(sums: dict[str, float], metrics: dict[str, float], n_tokens: float) -> None:
    """Sums add up; means are weighted by tokens (divided by the total at the end)."""
    for key, value in metrics.items():
        sums[key] = sums.get(key, 0.0) + (value * n_tokens if key.endswith(":mean") else value)


def averaged(sums: dict[str, float], tokens_total: float) -> dict[str, float]:
    return {k: (v / max(tokens_total, 1.0) if k.endswith(":mean") else v) for k, v in sums.items()}


def adam_step(optimizer: torch.optim.Optimizer, params: list[torch.Tensor], adam: AdamParams) -> float:
    """One AdamW step over `params` with `adam` exactly as sent, gradients cleared; the gradient's
    norm before clipping. A gradient that is not finite skips the step (cleared) with BadRequest."""
    adam.check()
    for group in optimizer.param_groups:
        group.update(lr=adam.learning_rate, betas=(adam.beta1, adam.beta2), eps=adam.eps, weight_decay=adam.weight_decay)
    grads = [p.grad for p in params if p.grad is not None]
    norm = float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))) if grads else 0.0
    if not math.isfinite(norm):
        optimizer.zero_grad(set_to_none=True)
        raise BadRequest("the accumulated gradient is not finite (NaN or infinity): the step was skipped and the gradient cleared")
    if adam.grad_clip_norm > 0 and grads:
        torch.nn.utils.clip_grad_norm_(params, adam.grad_clip_norm)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return norm


HEAD_CHUNK_POSITIONS = 512  # positions whose logits ([P, vocab], float32) exist at once; 0: all of a pass's at once


def target_logprobs(head: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor, active: torch.Tensor,
                    forward_only: bool, placement: Placement, head_rows: Any = None) -> torch.Tensor:
    """log p(target) [B, T] ([B, T, K] for soft targets) from the last hidden states: the
    unembedding with gradient at `active` positions only, without at the other real ones.
    `head_rows(positions)`: a context under which the head runs for those [P] flattened positions
    (a shared base's per-row adapters).

    The logits are computed HEAD_CHUNK_POSITIONS positions at a time, and with gradient each
    chunk's are recomputed in the backward (activation checkpointing) rather than kept: a pass
    never holds more than one chunk's [P, vocab] logits, their log-softmax and gradients (for
    SmolLM2's 49,152-token vocabulary, 512 positions are 100 MB each), however long its rows."""
    from contextlib import nullcontext

    from torch.utils.checkpoint import checkpoint

    lp = torch.zeros(targets.shape, device=mask.device)

    def score(h: torch.Tensor, picked: torch.Tensor, where: torch.Tensor) -> torch.Tensor:
        with placement.autocast(), (head_rows(where) if head_rows else nullcontext()):
            logits = head(h)
        return torch.log_softmax(logits.float(), dim=-1).gather(-1, picked.reshape(len(picked), -1)).reshape(picked.shape)

    for positions, grad in ((~active & mask.bool(), False), (active, not forward_only)):
        flat = positions.nonzero()
        size = HEAD_CHUNK_POSITIONS or max(len(flat), 1)
        for start in range(0, len(flat), size):
            where = torch.zeros_like(positions)
            where[flat[start : start + size, 0], flat[start : start + size, 1]] = True
            if grad and len(flat) > size:  # several chunks: keep none of their logits for the backward
                out = checkpoint(score, hidden[where], targets[where], where, use_reentrant=False)
            elif grad:
                out = score(hidden[where], targets[where], where)
            else:
                with torch.no_grad():
                    out = score(hidden[where].detach(), targets[where], where)
            lp = lp.index_put((where,), out)
    return lp


class LoraTrainer:
    """What a training client's model does beyond its forward-backward, for a base of its own
    (PrimitiveModel) and a shared one (shared_base.SharedAdapter): AdamW steps over `params`, and
    the checkpoint files, from `trainable_state()` (peft's parameter names, in `params` order) and
    `adapter_files()` (the peft folder)."""

    params: list[torch.Tensor]
    optimizer: torch.optim.Optimizer
    shape: LoraShape
    lora: LoraSpec
    base_name: str
    steps: int
    pending_tokens: int

    def trainable_state(self) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def adapter_files(self) -> dict[str, bytes]:
        raise NotImplementedError

    def close(self) -> None:
        """Nothing to give back (a shared base's adapter leaves its base here)."""

    def _fresh_optimizer(self) -> torch.optim.AdamW:
        p = AdamParams()
        return torch.optim.AdamW(self.params, lr=p.learning_rate, betas=(p.beta1, p.beta2), eps=p.eps, weight_decay=p.weight_decay)

    def optim_step(self, adam: AdamParams) -> dict[str, float]:
        """One AdamW step with `adam` exactly as sent, then the gradients are cleared."""
        try:
            norm = adam_step(self.optimizer, self.params, adam)
        except BadRequest:
            self.pending_tokens = 0
            raise
        self.steps += 1
        tokens, self.pending_tokens = self.pending_tokens, 0
        return {"grad_norm:mean": norm, "learning_rate:mean": adam.learning_rate, "tokens:sum": float(tokens)}

    def state_files(self, with_optimizer: bool) -> dict[str, Any]:
        """What a checkpoint of this model holds: the trainable weights, the peft adapter folder
        (`adapter/…`, what `PeftModel.from_pretrained` and vLLM read), the optimizer's state when
        asked."""
        from safetensors.torch import save as save_safetensors

        files = {"weights.safetensors": save_safetensors({k: v.contiguous() for k, v in self.trainable_state().items()}),
                 **self.adapter_files()}
        if with_optimizer:
            buf = io.BytesIO()
            torch.save(self.optimizer.state_dict(), buf)
            files["optimizer.pt"] = buf.getvalue()
        return files

    def load_state(self, weights: dict[str, torch.Tensor], optimizer_state: dict[str, Any] | None, steps: int) -> None:
        """Weights (and the optimizer's moments when given, else a fresh optimizer) of a checkpoint."""
        names = list(self.trainable_state())
        if set(weights) != set(names):
            raise BadRequest(f"the checkpoint's weights do not fit this model ({len(set(weights) ^ set(names))} tensors differ)")
        with torch.no_grad():
            for name, param in zip(names, self.params):
                param.copy_(weights[name])
        self.optimizer = self._fresh_optimizer()
        if optimizer_state is not None:
            self.optimizer.load_state_dict(optimizer_state)
        self.optimizer.zero_grad(set_to_none=True)
        self.pending_tokens = 0
        self.steps = steps

    def policy_info(self) -> dict[str, Any]:
        """policy.json: what the weights apply to (so `opentinker serve` and the registry take them)."""
        return {"base_model": self.base_name, "dtype": "float32", "adapter": self.lora.model_dump(mode="json"), "init_from": None,
                "tinker": asdict(self.shape)}


class PrimitiveModel(LoraTrainer):
    """One training client's model and optimizer. `steps`: optimizer steps taken."""

    def __init__(self, base, tokenizer, base_name: str, shape: LoraShape, placement: Placement | None = None):
        self.placement = placement or cpu()
        self.base_name, self.shape, self.tokenizer = base_name, shape, tokenizer
        lora = shape.spec()
        if shape.seed is not None:  # the adapter's initial A matrices follow the seed (B starts at zero)
            torch.manual_seed(shape.seed)
        base = base.to(dtype=self.placement.weights_dtype(trained=False))
        self.model = wrap_model(base, lora).to(self.placement.device)
        autocast_lora_inputs(self.model, self.placement.compute_dtype)
        for p in self.model.parameters():
            if p.requires_grad and p.dtype != torch.float32:
                p.data = p.data.float()
        self.lora = lora
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = self._fresh_optimizer()
        config = self.model.get_base_model().config.get_text_config()
        self.vocab_size = int(self.model.get_base_model().get_output_embeddings().weight.shape[0])
        self.context_length = int(getattr(config, "max_position_embeddings", 0) or 0) or None
        self.steps = 0
        self.pending_tokens = 0  # trained tokens since the last optimizer step
        self.arch = type(self.model.get_base_model()).__name__
        self.closed = False

    def close(self) -> None:
        """Its session ended (closed, or expired: its client is gone): a call running stops at its next micro-batch."""
        self.closed = True

    def _check(self, data: list[Any], loss_fn: str) -> list[dict[str, torch.Tensor]]:
        return checked_rows(data, loss_fn, self.vocab_size, self.context_length, self.base_name)

    def _target_logprobs(self, padded_rows: dict[str, torch.Tensor], mask: torch.Tensor, active: torch.Tensor,
                         forward_only: bool) -> torch.Tensor:
        """log p(target) at every position, [B, T]. The unembedding and its log-softmax run with
        gradient only at `active` positions (graded_positions): in RL data most positions are the
        prompt's, and their share of the backward is skipped. The values, and so the loss and the
        outputs, are the same everywhere."""
        lm = self.model.get_base_model()
        with torch.set_grad_enabled(not forward_only), self.placement.autocast():
            hidden = hidden_states(lm, padded_rows["tokens"], None if bool(mask.all()) else mask.long())
        return target_logprobs(lm.get_output_embeddings(), hidden, padded_rows["target_tokens"], mask, active, forward_only,
                               self.placement)

    def forward_backward(self, data: list[Any], loss_fn: str, config: dict[str, float], forward_only: bool = False
                         ) -> tuple[list[dict[str, np.ndarray]], dict[str, float]]:
        """Per datum its target logprobs; the loss's metrics (`loss:sum`, …). Unless `forward_only`,
        the loss's gradient is added to what earlier calls accumulated."""
        config = loss_config(loss_fn, config)
        rows = self._check(data, loss_fn)
        outputs: list[dict[str, np.ndarray]] = [{} for _ in rows]
        sums: dict[str, float] = {}
        tokens_total = 0.0
        self.model.train(not forward_only)
        for batch in micro_batches([len(r["tokens"]) for r in rows]):
            if self.closed:
                self.model.eval()
                raise BadRequest("the model was closed while its call ran")
            inputs, mask = padded([rows[i] for i in batch], self.placement.device)
            lp = self._target_logprobs(inputs, mask, graded_positions(inputs, mask, loss_fn, config, forward_only), forward_only)
            with torch.set_grad_enabled(not forward_only):
                out = primitive_loss(loss_fn, lp, inputs, mask, config)
            if not forward_only and out.loss.requires_grad:  # nothing has a gradient when every weight is 0
                out.loss.backward()
            n_tokens = float(mask.sum())
            tokens_total += n_tokens
            add_metrics(sums, out.metrics, n_tokens)
            lp = lp.detach().cpu().numpy()
            for r, i in enumerate(batch):
                outputs[i] = {"logprobs": row_logprobs(lp, r, rows[i])}
        self.model.eval()
        if not forward_only:
            self.pending_tokens += int(tokens_total)
        return outputs, averaged(sums, tokens_total)

    # -- state -----------------------------------------------------------------------------
    def trainable_state(self) -> dict[str, torch.Tensor]:
        return {n: p.detach().to("cpu", copy=True) for n, p in self.model.named_parameters() if p.requires_grad}

    def adapter_files(self) -> dict[str, bytes]:
        return adapter_files(self.model, save_embedding_layers=False)  # a LoRA on a tied lm_head leaves the embedding as it was


def shape_from_policy(info: dict[str, Any]) -> LoraShape:
    return LoraShape(**info["tinker"])


def dumps(obj: Any) -> bytes:
    return json.dumps(obj).encode()
