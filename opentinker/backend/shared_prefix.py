"""Shared-prefix scoring: each group's common prompt runs once, its samples' completions against it.

Why: the samples of a group share their prompt (≈66 of ≈72 tokens on the math demo), and a
per-sequence update runs the model over that prompt once per sample. Here the trainer runs the
group's longest common token prefix once, with gradients, keeping its hidden states and its
key/values; then the samples' completions (what follows the prefix in each record) run together
as one packed row against those key/values: each completion token sees the whole prefix and the
earlier tokens of its own completion, never another sample's, at the positions it has in its own
record (prefix length + offset). A sample's hidden states are the prefix's followed by its own,
so the loss is today's per-sequence loss, the same numbers up to float rounding, and its gradient
reaches the prefix's activations (which depend on a LoRA adapter) through one backward per group.

Multi-turn records share what they share: the prefix is the longest run of tokens every record
of the group starts with (a common first turn included); a group whose records share nothing
runs with an empty prefix, still packed. Nothing is padded: the prefix runs alone, completions
are packed into rows of at most `PACK_TOKENS` tokens and `micro_batch_size` records. When a group
needs several rows, each row's loss is backpropagated into detached copies of the prefix's
states (so memory holds one row's activations at a time) and the prefix's own backward then runs
once with the gradients they gathered: the same gradient as one backward of the summed loss.

Supported: causal language models whose layers all attend to every earlier token (no sliding
window), with "sdpa" or "eager" attention, which take a custom 4-D mask. Vision-language models
and others are scored per sequence (`supports`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Largest packed row of completion tokens: its mask is dense (rows x (prefix + rows) entries).
PACK_TOKENS = 2048
ATTENTION = ("sdpa", "eager")


def supports(lm) -> bool:
    """Can `lm` (a causal LM, not the peft wrapper) score records against a shared prefix?"""
    from opentinker.model.vision import is_vision_model

    config = lm.config
    if is_vision_model(lm) or config._attn_implementation not in ATTENTION:
        return False
    layer_types = getattr(config, "layer_types", None) or ["full_attention"]
    sliding = getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True)
    return not sliding and all(kind == "full_attention" for kind in layer_types)


def common_prefix_length(sequences: list[list[int]]) -> int:
    """Length of the longest token run that every sequence starts with."""
    first, n = sequences[0], min(len(s) for s in sequences)
    for i in range(n):
        token = first[i]
        if any(s[i] != token for s in sequences):
            return i
    return n


@dataclass
class GroupPlan:
    """One group's work: the records (indices into the update's list), how many leading tokens
    they all share, and the rows their completions are packed into."""

    members: list[int]
    prefix_length: int
    rows: list[list[int]]


def plan(token_ids: list[list[int]], group_ids: list[int], micro_batch_size: int, pack_tokens: int = PACK_TOKENS) -> list[GroupPlan]:
    """Records grouped by group id (in order of first appearance), each group's shared prefix, and
    its completions packed greedily into rows of at most `micro_batch_size` records and
    `pack_tokens` completion tokens (a longer completion gets a row of its own)."""
    groups: dict[int, list[int]] = {}
    for i, g in enumerate(group_ids):
        groups.setdefault(g, []).append(i)
    plans = []
    for members in groups.values():
        shared = common_prefix_length([token_ids[i] for i in members])
        rows: list[list[int]] = [[]]
        tokens = 0
        for i in members:
            n = len(token_ids[i]) - shared
            if rows[-1] and (len(rows[-1]) >= micro_batch_size or tokens + n > pack_tokens):
                rows.append([])
                tokens = 0
            rows[-1].append(i)
            tokens += n
        plans.append(GroupPlan(members, shared, rows))
    return plans


@dataclass
class Prefix:
    """A prefix's last hidden states [P, H] and, per layer, its keys and values [1, kv_heads, P, D]."""

    length: int
    hidden: torch.Tensor
    key_values: list[tuple[torch.Tensor, torch.Tensor]]

    def tensors(self) -> list[torch.Tensor]:
        return [self.hidden, *(t for kv in self.key_values for t in kv)]

    def detached(self) -> Prefix:
        """Copies cut from the graph that collect gradients (see `backward_from`)."""
        cut = [t.detach().requires_grad_(t.requires_grad) for t in self.tensors()]
        return Prefix(self.length, cut[0], list(zip(cut[1::2], cut[2::2])))

    def backward_from(self, detached: Prefix) -> None:
        """Run this prefix's backward with the gradients its detached copy gathered."""
        pairs = [(t, c.grad) for t, c in zip(self.tensors(), detached.tensors()) if t.requires_grad and c.grad is not None]
        if pairs:
            torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs])


def run_prefix(lm, ids: torch.Tensor) -> Prefix:
    """Run the shared tokens `ids` [P] once (with gradients when enabled); P may be 0."""
    if ids.numel() == 0:
        hidden = torch.zeros((0, lm.config.get_text_config().hidden_size), device=ids.device)
        return Prefix(0, hidden, [])
    out = lm.get_decoder()(input_ids=ids[None], use_cache=True)
    key_values = [(layer.keys, layer.values) for layer in out.past_key_values.layers]
    return Prefix(ids.numel(), out.last_hidden_state[0], key_values)


def _completion_mask(lengths: torch.Tensor, prefix_length: int, attention: str, dtype: torch.dtype) -> torch.Tensor:
    """[1, 1, N, P + N] for N packed completion tokens: the whole prefix, then causal within each
    completion and nothing of the others. Boolean for sdpa, additive (0 / min) for eager."""
    n = int(lengths.sum())
    device = lengths.device
    segment = torch.repeat_interleave(torch.arange(len(lengths), device=device), lengths)
    local = torch.arange(n, device=device) - (torch.cumsum(lengths, 0) - lengths)[segment]
    own = (segment[:, None] == segment[None, :]) & (local[None, :] <= local[:, None])
    mask = torch.cat([torch.ones((n, prefix_length), dtype=torch.bool, device=device), own], dim=1)[None, None]
    if attention == "eager":
        return torch.zeros(mask.shape, dtype=dtype, device=device).masked_fill(~mask, torch.finfo(dtype).min)
    return mask


def selected_hidden(lm, prefix: Prefix, input_ids: torch.Tensor, attention_mask: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """Hidden states at the positions whose next token is trainable, [N, H], in the order of
    `hidden[:, :-1][loss_mask.bool()]` on the right-padded batch (`input_ids` [B, L], its
    `attention_mask`, `loss_mask` [B, L-1]) whose records all start with the prefix's tokens."""
    from transformers import DynamicCache

    p = prefix.length
    lengths = attention_mask.sum(1) - p  # each record's completion length
    if int(lengths.min()) < 0:
        raise ValueError("a record is shorter than its group's shared prefix")
    hidden = prefix.hidden
    if int(lengths.sum()) > 0:
        keep = torch.arange(input_ids.shape[1], device=input_ids.device)[None, :] - p
        keep = (keep >= 0) & (keep < lengths[:, None])
        ids = input_ids[keep][None]  # row-major: each completion in turn
        offsets = torch.cumsum(lengths, 0) - lengths
        positions = p + torch.arange(ids.shape[1], device=ids.device) - torch.repeat_interleave(offsets, lengths)
        cache = DynamicCache(ddp_cache_data=prefix.key_values, config=lm.config) if p else None
        mask = _completion_mask(lengths, p, lm.config._attn_implementation, prefix.hidden.dtype)
        out = lm.get_decoder()(input_ids=ids, attention_mask=mask, position_ids=positions[None], past_key_values=cache, use_cache=p > 0)
        hidden = torch.cat([hidden.to(out.last_hidden_state.dtype), out.last_hidden_state[0]])
    else:
        offsets = torch.zeros_like(lengths)
    rows, t = loss_mask.bool().nonzero(as_tuple=True)
    index = torch.where(t < p, t, t + offsets[rows])
    return hidden[index]
