"""Decoding over fixed key/value slots: on a GPU each decode step is one CUDA graph replay (on the
CPU the same slots run eagerly when asked for: StreamEngine(slots=True); not by default, for memory).

Why: a transformers decode step launches a few hundred small kernels per layer from Python (36,079
launches for a 32-token rollout; the GPU busy 23% of a step at batch 128, measured). A captured
CUDA graph replays all of them in one launch, but it needs fixed shapes and addresses. So the
running rows of the stream engine (stream.py) live here in fixed slots of preallocated key/value
tensors, [slots, kv_heads, capacity, head_dim] per layer. Rows are left-padded as in stream.py and
every step writes one shared column (`col`); a row's positions are its own, a mask says which columns
are its tokens, and attention reads the whole capacity through it. A joining row takes the lowest
free slot, its prefilled keys/values copied in right-aligned at `col`; a leaving row frees its slot.
When `col` reaches the capacity, the columns no running row uses are dropped (a shift left), or
the capacity doubles. One graph per bucket of slots (1, 2, 4, ..., the engine's batch size): the
smallest that covers the highest slot in use.

The weights a graph reads are a copy of the engine's model (`refresh`, at the start of each busy
stretch and after every weight change, into the same tensors, so an update or an adapter swap
never leaves a graph stale): the linear layers' weights in the compute precision (what autocast
would cast them to at every step), the rest (embeddings, norms) as they are, a LoRA adapter merged
into its layers, so LoRA decodes at the speed of the base (one adapter per engine; a shared base's
rows on several adapters decode eagerly, stream.py). The copy runs under the same autocast as the
model, so it computes what the model computes.

Chosen over transformers' own paths: `generate` with a static cache and torch.compile
(`reduce-overhead`) compiles per batch shape (minutes for a 1.5B model) and runs whole requests, not
rows that join and leave; its continuous-batching manager samples by itself (no per-sequence
generators, no logprobs of our contract). Capturing the model's own forward over this slot cache
keeps transformers' modules and costs about a second per bucket.
"""

from __future__ import annotations

import copy as copy_module
import logging
from contextlib import nullcontext
from typing import Any

import torch
from torch import nn

from opentinker.backend.device import Placement
from opentinker.backend.prefix_cache import LayerStates

log = logging.getLogger(__name__)

MIN_CAPACITY = 256
ATTENTION = "opentinker_slots"  # the decode copy's attention implementation (slot_attention)


def supports_slots(model) -> str | None:
    """Why `model` cannot decode over slots (None: it can)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = base.config
    if getattr(config, "vision_config", None) is not None:
        return "a vision-language model (its positions come from its images)"
    if base.get_decoder() is None or base.get_output_embeddings() is None:
        return "no decoder or output embeddings to call"
    for module in base.modules():
        if getattr(module, "lora_magnitude_vector", None):  # DoRA: not a plain weight delta
            return "a DoRA adapter"
    return None


def slot_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Attention of a decode step over the slots: the query heads that share a key/value head are
    multiplied against it together, so the keys and values are read once, never repeated per head
    (transformers' SDPA path repeats them whenever a mask is given: 12 ms of a 19 ms step at batch
    128 of the 1.5B shape, profiled). Prefill (more than one query position) goes to SDPA."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if query.shape[2] != 1:
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
    rows, heads, _, dim = query.shape
    kv_heads = key.shape[1]
    q = query.reshape(rows, kv_heads, heads // kv_heads, dim)
    scale = scaling if scaling is not None else dim ** -0.5
    scores = torch.matmul(q, key.transpose(-1, -2)).float() * scale  # [rows, kv_heads, group, width]
    if attention_mask is not None:
        scores = scores + attention_mask.float()  # [rows, 1, 1, width]
    probs = torch.softmax(scores, dim=-1).to(value.dtype)
    out = torch.matmul(probs, value)  # [rows, kv_heads, group, dim]
    return out.reshape(rows, 1, heads, dim), None


def _register_attention() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTENTION, slot_attention)
    AttentionMaskInterface.register(ATTENTION, sdpa_mask)


class SlotCache:
    """What a transformers attention layer calls on its cache: the step's keys and values written
    at the shared column, the slots' whole capacity returned."""

    is_compileable = False

    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor], rows: int, column: torch.Tensor):
        self.keys, self.values, self.rows, self.column = keys, values, rows, column

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        keys, values = self.keys[layer_idx][: self.rows], self.values[layer_idx][: self.rows]
        keys.index_copy_(2, self.column, key_states.to(keys.dtype))
        values.index_copy_(2, self.column, value_states.to(values.dtype))
        return keys, values

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0  # positions are always passed, never derived from the cache


class SlotDecoder:
    """The running rows' key/values in fixed slots and the decode step over them (module docstring)."""

    def __init__(self, slots: int, placement: Placement, graphs: bool | None = None):
        self.slots, self.placement = slots, placement
        self.graphs_on = placement.device.type == "cuda" if graphs is None else graphs
        self.source: Any = None  # the engine's model the copy was made from
        self.model: Any = None  # the copy (decoder + output embeddings)
        self.fills: list[tuple[torch.Tensor, Any]] = []  # (copy's tensor, how to get its value from the source)
        self.capacity = 0
        self.col = 0
        self.free = list(range(slots))
        self.graphs: dict[int, tuple[Any, torch.Tensor]] = {}
        self.pool = None
        self.replays = self.eager_steps = self.captures = 0
        self.graph_error: str | None = None  # why capturing failed (decoding went on eagerly)
        self.events: list[tuple[Any, Any]] | None = None  # a list: (start, end) CUDA events around each replay (bench/gpu_decode.py)

    # -- the weights ----------------------------------------------------------------------------
    @torch.no_grad()
    def refresh(self, model) -> None:
        """Fill the copy from `model` (made the first time, or when the engine's model changed)."""
        if model is not self.source:
            self._build(model)
        for target, value in self.fills:
            target.copy_(value())

    def _build(self, model) -> None:
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        _register_attention()
        config = copy_module.deepcopy(base.config)
        with torch.device("meta"):
            copy = type(base)(config)
        copy.config._attn_implementation = ATTENTION  # decode steps read the slots without repeating them per head
        copy.to_empty(device=self.placement.device)
        sources = dict(base.named_modules())
        dtype = self.placement.compute_dtype
        fills = []
        for module_name, module in copy.named_modules():
            source = sources[module_name]
            for name, param in list(module.named_parameters(recurse=False)):
                is_linear_weight = isinstance(module, nn.Linear) and name == "weight"
                fresh = torch.empty_like(param, dtype=dtype if is_linear_weight else _tensor(source, name).dtype)
                setattr(module, name, nn.Parameter(fresh, requires_grad=False))  # also unties a tied head
                fills.append((fresh, _value_of(source, name)))
            for name, _ in list(module.named_buffers(recurse=False)):  # rotary frequencies and the like: as the source's
                setattr(module, name, getattr(source, name).detach().clone())
        copy.eval()
        self.source, self.model, self.fills = model, copy, fills
        self.decoder, self.head = copy.get_decoder(), copy.get_output_embeddings()
        config = copy.config
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        self.layers = text.num_hidden_layers
        self.kv_heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
        self.head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        self._allocate(max(self.capacity, MIN_CAPACITY))

    # -- the slots -------------------------------------------------------------------------------
    def _allocate(self, capacity: int) -> None:
        """Slot tensors of `capacity` columns, what the old ones held kept in their columns."""
        device, dtype = self.placement.device, self.placement.compute_dtype
        shape = (self.slots, self.kv_heads, capacity, self.head_dim)
        keys = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(self.layers)]
        values = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(self.layers)]
        attend = torch.zeros((self.slots, capacity), device=device, dtype=torch.long)
        if self.capacity:
            old = self.capacity
            for new, prev in zip(keys + values, self.keys + self.values):
                new[:, :, :old] = prev
            attend[:, :old] = self.attend
        else:
            self.ids = torch.zeros(self.slots, device=device, dtype=torch.long)
            self.positions = torch.zeros(self.slots, device=device, dtype=torch.long)
            self.column = torch.zeros(1, device=device, dtype=torch.long)
        self.keys, self.values, self.attend, self.capacity = keys, values, attend, capacity
        self.graphs.clear()  # they read the old tensors
        if self.graphs_on:
            self.pool = torch.cuda.graph_pool_handle()

    def take(self, n: int) -> list[int]:
        """The lowest `n` free slots (the caller checked there are)."""
        self.free.sort()
        taken, self.free = self.free[:n], self.free[n:]
        return taken

    def release(self, slots: list[int]) -> None:
        if slots:
            self.attend[torch.tensor(slots, device=self.attend.device)] = 0
        self.free.extend(slots)

    def reset(self) -> None:
        self.free = list(range(self.slots))
        if self.capacity:
            self.attend.zero_()
        self.col = 0

    def join(self, slots: list[int], layers: list[tuple[torch.Tensor, torch.Tensor]], mask: torch.Tensor,
             positions: torch.Tensor) -> None:
        """New rows (their prefilled key/values [rows, kv_heads, width, head_dim] per layer,
        left-padded, their mask and next positions) into `slots`, right-aligned at `col`."""
        width = mask.shape[1]
        if width >= self.capacity:
            self._allocate(_power_of_two_above(width))
        if width > self.col:
            self._shift(width - self.col)
        index = torch.tensor(slots, device=self.attend.device)
        start = self.col - width
        for (k, v), keys, values in zip(layers, self.keys, self.values):
            keys[index, :, start: self.col] = k.to(keys.dtype)
            values[index, :, start: self.col] = v.to(values.dtype)
        self.attend[index] = 0
        self.attend[index, start: self.col] = mask.to(self.attend.dtype)
        self.positions[index] = positions

    def states(self, slot: int) -> LayerStates:
        """A slot's key/values over its own columns ([kv_heads, tokens, head_dim] per layer)."""
        columns = self.attend[slot, : self.col].nonzero().squeeze(-1)
        return [(k[slot].index_select(1, columns), v[slot].index_select(1, columns)) for k, v in zip(self.keys, self.values)]

    def _shift(self, by: int) -> None:
        """Move every column `by` to the right (by > 0) or left; what falls off was no running row's."""
        for t in self.keys + self.values:
            t.copy_(torch.roll(t, by, dims=2))
        self.attend.copy_(torch.roll(self.attend, by, dims=1))
        if by > 0:
            self.attend[:, :by] = 0
        else:
            self.attend[:, by:] = 0
        self.col += by

    def _make_room(self, live: list[int]) -> None:
        """A free column at `col`: drop the columns no running row uses, else double the capacity."""
        used = self.attend[torch.tensor(live, device=self.attend.device), : self.col].any(0).nonzero()
        first = int(used[0]) if len(used) else self.col
        if first > 0:
            self._shift(-first)
        else:
            self._allocate(self.capacity * 2)

    # -- the step --------------------------------------------------------------------------------
    @torch.no_grad()
    def decode(self, slots: list[int], tokens: list[int]) -> torch.Tensor:
        """Feed each slot its last token; the next-token logits, one row per slot in `slots`' order."""
        if self.col >= self.capacity:
            self._make_room(slots)
        rows = _bucket(max(slots) + 1, self.slots) if self.graphs_on else max(slots) + 1
        fed = torch.zeros(rows, dtype=torch.long)
        fed[slots] = torch.tensor(tokens, dtype=torch.long)
        self.ids[:rows].copy_(fed, non_blocking=True)
        self.column.fill_(self.col)
        graph = None
        if self.graphs_on:
            try:
                graph, logits = self._graph(rows)
            except Exception as err:  # noqa: BLE001 - decoding goes on eagerly, and says why once
                self.graphs_on, self.graph_error = False, f"{type(err).__name__}: {err}"
                log.warning("decoding without CUDA graphs: capturing one failed (%s)", self.graph_error, exc_info=True)
                self.column.fill_(self.col)
        if graph is not None:
            if self.events is not None:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                graph.replay()
                end.record()
                self.events.append((start, end))
            else:
                graph.replay()
            self.replays += 1
        else:
            logits = self._body(rows)
            self.eager_steps += 1
        self.col += 1
        return logits[torch.tensor(slots, device=logits.device)]

    def _body(self, rows: int) -> torch.Tensor:
        """One decode step of the first `rows` slots (what a graph captures)."""
        attend = self.attend[:rows]
        attend.index_fill_(1, self.column, 1)
        dtype = self.placement.compute_dtype
        bias = torch.zeros(attend.shape, device=attend.device, dtype=dtype).masked_fill(attend == 0, torch.finfo(dtype).min)
        cache = SlotCache(self.keys, self.values, rows, self.column)
        hidden = self.decoder(input_ids=self.ids[:rows, None], position_ids=self.positions[:rows, None],
                              attention_mask=bias[:, None, None, :], past_key_values=cache, use_cache=True).last_hidden_state
        logits = self.head(hidden[:, -1])
        self.positions[:rows] += 1
        return logits

    def _graph(self, rows: int):
        """The captured step of `rows` slots (captured the first time: two warm-up runs on a side
        stream, as torch asks, then the capture; the positions the warm-ups advanced are put back)."""
        if rows in self.graphs:
            return self.graphs[rows]
        saved = self.positions.clone()
        try:
            return self._capture(rows)
        finally:
            self.positions.copy_(saved)

    def _capture(self, rows: int):
        region = torch.autocast("cuda", dtype=self.placement.compute_dtype, cache_enabled=False) \
            if self.placement.compute_dtype != torch.float32 else nullcontext()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side), region:
            for _ in range(2):
                self._body(rows)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with region, torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            logits = self._body(rows)
        self.captures += 1
        self.graphs[rows] = (graph, logits)
        log.debug("captured a decode graph of %d slots (capacity %d)", rows, self.capacity)
        return self.graphs[rows]


def _bucket(rows: int, most: int) -> int:
    bucket = 1
    while bucket < rows:
        bucket *= 2
    return min(bucket, most)


def _power_of_two_above(n: int) -> int:
    size = MIN_CAPACITY
    while size <= n:
        size *= 2
    return size


def _is_lora(module) -> bool:
    return hasattr(module, "base_layer") and hasattr(module, "get_delta_weight")


def _tensor(module, name: str) -> torch.Tensor:
    """A source module's parameter `name` (a LoRA layer's: its base layer's)."""
    if _is_lora(module):
        return getattr(module.base_layer, name)
    return getattr(module, name)


def _value_of(module, name: str):
    """How to read the source's current value of a parameter: a LoRA layer's weight is its base
    weight plus the deltas of its active adapters (unless they are merged into it already)."""
    if _is_lora(module):
        base = module.base_layer
        if name != "weight":
            return lambda: getattr(base, name)

        def merged() -> torch.Tensor:
            weight = base.weight
            if getattr(module, "merged", False) or getattr(module, "disable_adapters", False):
                return weight
            for adapter in module.active_adapters:
                if adapter in module.lora_A:
                    weight = weight + module.get_delta_weight(adapter).to(weight.dtype)
            return weight

        return merged
    return lambda: getattr(module, name)
