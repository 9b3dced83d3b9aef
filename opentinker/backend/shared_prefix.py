"""Shared-prefix scoring: each group's common prompt runs once, its samples' completions against it.

Why: the samples of a group share their prompt (≈66 of ≈72 tokens on the math demo), and a
per-sequence update runs the model over that prompt once per sample. Here the trainer runs the
group's longest common token prefix once, with gradients, keeping its hidden states and its
key/values; then the samples' completions (what follows the prefix in each record) run against
those key/values: each completion token sees its group's whole prefix and the earlier tokens of
its own completion, never another sample's, at the position it has in its own record (prefix
length + offset). A sample's hidden states are the prefix's followed by its own, so the loss is
the per-sequence loss, the same numbers up to float rounding, and its gradient reaches the
prefix's activations (which depend on a LoRA adapter) through one backward per group.

Multi-turn records share what they share: the prefix is the longest run of tokens every record
of the group starts with (a common first turn included); a group whose records share nothing
has an empty prefix. Nothing is padded: whole groups are packed together (a pack holds at most
`micro_batch_size` records and `PACK_TOKENS` tokens): their prefixes in one row (each causal
within itself, positions from 0), then all their completions in one row against it, each forward
with a 4-D mask. A group larger than a pack is one alone, its completions in several rows: each
row's loss is backpropagated into detached copies of the prefix's states (memory holds one row's
activations at a time) and the prefix's own backward then runs once with the gradients they
gathered, the same gradient as one backward of the summed loss.

Supported: causal language models whose layers all attend to every earlier token (no sliding
window), with "sdpa" or "eager" attention, which take a custom 4-D mask. Vision-language models
and others are scored per sequence (`supports`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Most tokens in a pack (prefixes once plus completions): its attention masks are dense, so the
# attention of a packed row costs its length squared whatever it holds.
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
class Pack:
    """Work for one backward: groups (their records, as indices into the update's list, and how
    many leading tokens each group's records share), run as one packed row of prefixes, and the
    rows their completions are packed into (one, unless a single large group needs several)."""

    groups: list[list[int]]
    prefix_lengths: list[int]
    rows: list[list[int]]

    def slot(self, record: int) -> int:
        """Which of the pack's groups (prefixes) a record belongs to."""
        return next(k for k, members in enumerate(self.groups) if record in members)


def plan(token_ids: list[list[int]], group_ids: list[int], micro_batch_size: int, pack_tokens: int = PACK_TOKENS) -> list[Pack]:
    """Records grouped by group id (in order of first appearance) with each group's shared prefix;
    whole groups packed together while the pack holds at most `micro_batch_size` records and
    `pack_tokens` tokens (prefixes once, plus completions); a group larger than that is a pack of
    its own whose completions fill rows of at most those sizes (a longer completion gets its own)."""
    by_group: dict[int, list[int]] = {}
    for i, g in enumerate(group_ids):
        by_group.setdefault(g, []).append(i)
    packs: list[Pack] = []
    room = (0, 0)  # records and tokens left in the last pack, if another group may join it
    for members in by_group.values():
        shared = common_prefix_length([token_ids[i] for i in members])
        completions = [len(token_ids[i]) - shared for i in members]
        tokens = shared + sum(completions)
        if len(members) <= room[0] and tokens <= room[1]:
            pack = packs[-1]
            pack.groups.append(members)
            pack.prefix_lengths.append(shared)
            pack.rows[0].extend(members)
            room = (room[0] - len(members), room[1] - tokens)
        elif len(members) <= micro_batch_size and tokens <= pack_tokens:
            packs.append(Pack([members], [shared], [list(members)]))
            room = (micro_batch_size - len(members), pack_tokens - tokens)
        else:
            rows: list[list[int]] = [[]]
            used = 0
            for i, n in zip(members, completions):
                if rows[-1] and (len(rows[-1]) >= micro_batch_size or used + n > pack_tokens):
                    rows.append([])
                    used = 0
                rows[-1].append(i)
                used += n
            packs.append(Pack([members], [shared], rows))
            room = (0, 0)
    return packs


@dataclass
class Prefix:
    """The packed prefixes of a pack's groups: their lengths, last hidden states [sum P, H] and,
    per layer, keys and values [1, kv_heads, sum P, D]."""

    lengths: list[int]
    hidden: torch.Tensor
    key_values: list[tuple[torch.Tensor, torch.Tensor]]

    def tensors(self) -> list[torch.Tensor]:
        return [self.hidden, *(t for kv in self.key_values for t in kv)]

    def detached(self) -> Prefix:
        """Copies cut from the graph that collect gradients (see `backward_from`)."""
        cut = [t.detach().requires_grad_(t.requires_grad) for t in self.tensors()]
        return Prefix(self.lengths, cut[0], list(zip(cut[1::2], cut[2::2])))

    def backward_from(self, detached: Prefix) -> None:
        """Run this prefix's backward with the gradients its detached copy gathered."""
        pairs = [(t, c.grad) for t, c in zip(self.tensors(), detached.tensors()) if t.requires_grad and c.grad is not None]
        if pairs:
            torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs])


def _mask(query: tuple[torch.Tensor, ...], key: tuple[torch.Tensor, ...], attention: str, dtype: torch.dtype) -> torch.Tensor:
    """[1, 1, Q, K] from each token's (group, record, position), record -1 for prefix tokens: a
    token sees the tokens of its group's prefix and of its own record, at positions up to its own.
    Boolean for float32 sdpa; additive (0 / min) in `dtype` for eager and for sdpa in a reduced
    precision (the CPU's bfloat16 SDPA took twice as long with a boolean mask, measured)."""
    (qg, qr, qp), (kg, kr, kp) = query, key
    mask = (qg[:, None] == kg[None, :]) & ((kr[None, :] == -1) | (kr[None, :] == qr[:, None])) & (kp[None, :] <= qp[:, None])
    mask = mask[None, None]
    if attention == "eager" or dtype != torch.float32:
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, torch.finfo(dtype).min)
    return mask


def _attention_dtype(device: torch.device) -> torch.dtype:
    """The precision attention runs in here: autocast's where it is on, else float32."""
    return torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else torch.float32


def _prefix_tokens(lengths: list[int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    sizes = torch.tensor(lengths, device=device)
    group = torch.repeat_interleave(torch.arange(len(lengths), device=device), sizes)
    position = torch.arange(int(sizes.sum()), device=device) - torch.repeat_interleave(torch.cumsum(sizes, 0) - sizes, sizes)
    return group, torch.full_like(group, -1), position


def run_prefix(lm, ids: list[torch.Tensor]) -> Prefix:
    """Run each group's shared tokens (`ids`, one tensor per group, possibly empty) once, packed in
    one row, with gradients when enabled."""
    lengths = [int(t.numel()) for t in ids]
    device = ids[0].device
    if not sum(lengths):
        return Prefix(lengths, torch.zeros((0, lm.config.get_text_config().hidden_size), device=device), [])
    packed = torch.cat(ids)[None]
    if len([n for n in lengths if n]) == 1:  # one prefix: plain causal attention
        out = lm.get_decoder()(input_ids=packed, use_cache=True)
    else:
        tokens = _prefix_tokens(lengths, device)
        mask = _mask(tokens, tokens, lm.config._attn_implementation, _attention_dtype(device))
        out = lm.get_decoder()(input_ids=packed, attention_mask=mask, position_ids=tokens[2][None], use_cache=True)
    key_values = [(layer.keys, layer.values) for layer in out.past_key_values.layers]
    return Prefix(lengths, out.last_hidden_state[0], key_values)


def selected_hidden(lm, prefix: Prefix, slots: torch.Tensor, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                    loss_mask: torch.Tensor) -> torch.Tensor:
    """Hidden states at the positions whose next token is trainable, [N, H], in the order of
    `hidden[:, :-1][loss_mask.bool()]` on the right-padded batch (`input_ids` [B, L], its
    `attention_mask`, `loss_mask` [B, L-1]) whose record b starts with the tokens of the prefix
    of group `slots[b]`; only what follows the prefixes runs."""
    from transformers import DynamicCache

    device = input_ids.device
    sizes = torch.tensor(prefix.lengths, device=device)
    starts = torch.cumsum(sizes, 0) - sizes
    p, total = sizes[slots], int(sizes.sum())  # each record's prefix length, all prefixes'
    lengths = attention_mask.sum(1) - p  # each record's completion length
    if int(lengths.min()) < 0:
        raise ValueError("a record is shorter than its group's shared prefix")
    offsets = torch.cumsum(lengths, 0) - lengths
    hidden = prefix.hidden
    if int(lengths.sum()) > 0:
        local = torch.arange(input_ids.shape[1], device=device)[None, :] - p[:, None]
        ids = input_ids[(local >= 0) & (local < lengths[:, None])][None]  # row-major: each completion in turn
        record = torch.repeat_interleave(torch.arange(len(lengths), device=device), lengths)
        query = (slots[record], record, p[record] + torch.arange(ids.shape[1], device=device) - offsets[record])
        key = tuple(torch.cat([a, b]) for a, b in zip(_prefix_tokens(prefix.lengths, device), query))
        mask = _mask(query, key, lm.config._attn_implementation, _attention_dtype(device))
        cache = DynamicCache(ddp_cache_data=prefix.key_values, config=lm.config) if total else None
        out = lm.get_decoder()(input_ids=ids, attention_mask=mask, position_ids=query[2][None], past_key_values=cache, use_cache=bool(total))
        hidden = torch.cat([hidden.to(out.last_hidden_state.dtype), out.last_hidden_state[0]])
    rows, t = loss_mask.bool().nonzero(as_tuple=True)
    index = torch.where(t < p[rows], starts[slots[rows]] + t, total + offsets[rows] + t - p[rows])
    return hidden[index]
