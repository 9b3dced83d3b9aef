"""Key/values of rows of different lengths in one batch: left-padded to one width, the padding
masked (positions come from the mask), so a row computes what it computes alone."""

from __future__ import annotations

from typing import Any

import torch

from opentinker.backend.prefix_cache import LayerStates


def layers_of(cache: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer, (keys, values) shaped [rows, kv_heads, width, head_dim]."""
    return [(layer.keys, layer.values) for layer in cache.layers]


def cache_of(layers: list[tuple[torch.Tensor, torch.Tensor]]) -> Any:
    from transformers import DynamicCache

    return DynamicCache(ddp_cache_data=layers)


def pad_left(x: torch.Tensor, width: int, dim: int = 2) -> torch.Tensor:
    """`x` widened to `width` along `dim` with zeros on the left."""
    missing = width - x.shape[dim]
    if not missing:
        return x
    shape = list(x.shape)
    shape[dim] = missing
    return torch.cat([x.new_zeros(shape), x], dim=dim)


def prompt_inputs(prompts: list[list[int]], hits: list[tuple[int, LayerStates | None]], pad_id: int):
    """(ids, mask, cache) of the prompts left-padded to one width; where a prefix is cached its
    key/values fill the first columns (right-aligned) and only the rest is run."""
    rows = len(prompts)
    cached = max(n for n, _ in hits)
    if not cached:
        width = max(len(p) for p in prompts)
        ids = torch.full((rows, width), pad_id, dtype=torch.long)
        mask = torch.zeros((rows, width), dtype=torch.long)
        for row, p in enumerate(prompts):
            ids[row, width - len(p):] = torch.tensor(p, dtype=torch.long)
            mask[row, width - len(p):] = 1
        return ids, mask, None
    rest = max(len(p) - n for p, (n, _) in zip(prompts, hits))
    states = next(s for _, s in hits if s is not None)
    ids = torch.full((rows, cached + rest), pad_id, dtype=torch.long)
    mask = torch.zeros((rows, cached + rest), dtype=torch.long)
    layers = [(k.new_zeros((rows, k.shape[0], cached, k.shape[2])), v.new_zeros((rows, v.shape[0], cached, v.shape[2]))) for k, v in states]
    for row, (p, (n, row_states)) in enumerate(zip(prompts, hits)):
        tail = p[n:]
        ids[row, cached - n: cached] = torch.tensor(p[:n], dtype=torch.long)
        ids[row, cached + rest - len(tail):] = torch.tensor(tail, dtype=torch.long)
        mask[row, cached - n: cached] = 1
        mask[row, cached + rest - len(tail):] = 1
        for (keys, values), (k, v) in zip(layers, row_states or []):
            keys[row, :, cached - n:] = k
            values[row, :, cached - n:] = v
    return ids, mask, cache_of(layers)
