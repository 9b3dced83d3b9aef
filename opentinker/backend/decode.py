"""The rollout engine's decode loop: a row leaves the batch the moment its completion ends.

`model.generate` keeps every row of a batch until the last one ends: a row that stopped early
is still run on padding at every step (a group of 32 short answers held to its longest one).
Here a row that produced an end-of-turn token or reached its token budget is dropped from the
running batch at once, its key/values too (`Cache.reorder_cache` on the batch dimension), and
the batch ends when no row is left.

What a row gets is what `model.generate` gave it: the same inputs to the model (positions from
the attention mask, the mask dropped when it has no padding, `logits_to_keep=1`), the same
sampling distribution (temperature, top-k, top-p: transformers' warpers; the logprob recorded
is the token's under that processed distribution), and the same random draws: `torch.multinomial` is called on the full batch's shape at every step (the rows that left
have a placeholder distribution), so each row reads the same noise as before. Only the row
count of the forward passes changes. With `compact=False` rows stay to the end as they do in
`model.generate` (finished ones fed padding): the reference the tests compare with.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch

from opentinker.backend.device import Placement
from opentinker.backend.prefix_cache import LayerStates


@dataclass
class Decoded:
    """Per row of the batch: sampled tokens (cut at the first end token or at the budget), their
    logprobs, "stop" or "length", and (when asked for) the key/values of the tokens the model
    ran for it. `forwards`: forward passes; `positions`: batch rows summed over them, each a
    next-token distribution computed."""

    token_ids: list[list[int]]
    logprobs: list[list[float]]
    finish_reasons: list[str]
    states: list[LayerStates | None] = field(default_factory=list)
    forwards: int = 0
    positions: int = 0


def finish(tokens: list[int], budget: int, stop_ids: set[int]) -> tuple[int, str]:
    """How many of a row's sampled `tokens` it keeps, and why it ended."""
    stop_at = next((k for k, t in enumerate(tokens) if t in stop_ids), None)
    if stop_at is not None and stop_at < budget:
        return stop_at + 1, "stop"
    return max(0, min(len(tokens), budget)), "length"


def logits_kwargs(model) -> dict[str, Any]:
    """`logits_to_keep=1` where the model takes it (as `generate` passes it): only the last
    position's logits are computed."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(base.forward).parameters else {}


def keeps_states(cache) -> bool:
    """Whether a row's key/values can be taken out of `cache` for the prefix cache."""
    from transformers import DynamicCache

    return isinstance(cache, DynamicCache) and not any(layer.is_sliding for layer in cache.layers)


def row_states(cache, row: int, columns: torch.Tensor) -> LayerStates:
    return [(layer.keys[row].index_select(1, columns), layer.values[row].index_select(1, columns)) for layer in cache.layers]


class Chooser:
    """Next tokens from logits, and the log-probabilities of the distribution they were drawn from:
    argmax when greedy (logprobs at temperature 1), else a draw from softmax(logits / T) after
    top-k and top-p (transformers' warpers, in `generate`'s order; tokens they remove get -inf),
    with `torch.multinomial` called on the shape of the whole batch.

    `generators[row]`: the generator a row draws from (None: torch's global one). Rows of one
    generator draw together, on the shape of all their rows and only while one of them runs, so
    what they draw does not depend on the other rows of the batch: a tenant's own seeded stream
    on a shared base gives the same tokens whoever else is in the batch."""

    def __init__(self, rows: int, temperature: float | None, top_k: int | None, top_p: float,
                 generators: list[torch.Generator | None] | None = None):
        from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

        self.rows, self.temperature, self.warpers = rows, temperature, []
        self.groups: list[tuple[list[int], torch.Generator | None]] | None = None
        if generators is not None and any(g is not None for g in generators):
            by_generator: dict[int, tuple[list[int], torch.Generator | None]] = {}
            for row, gen in enumerate(generators):
                by_generator.setdefault(id(gen), ([], gen))[0].append(row)
            self.groups = list(by_generator.values())
        if temperature is not None and top_k:
            self.warpers.append(TopKLogitsWarper(top_k=top_k))
        if temperature is not None and top_p < 1.0:
            self.warpers.append(TopPLogitsWarper(top_p=top_p))

    def __call__(self, logits: torch.Tensor, batch_rows: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        if self.temperature is None:
            return torch.argmax(logits, dim=-1), torch.log_softmax(logits, dim=-1)
        scores = logits / self.temperature if self.temperature != 1.0 else logits
        for warp in self.warpers:
            scores = warp(None, scores)
        logp = torch.log_softmax(scores, dim=-1)
        probs = logp.exp()  # the same distribution, one pass over the vocabulary fewer than a second softmax
        if self.groups is None:
            return _draw(probs, list(range(self.rows)), batch_rows, None), logp
        at = {row: k for k, row in enumerate(batch_rows)}
        tokens = torch.zeros(len(batch_rows), dtype=torch.long, device=probs.device)
        for rows, gen in self.groups:
            running = [row for row in rows if row in at]
            if running:
                where = torch.tensor([at[row] for row in running], device=probs.device)
                tokens[where] = _draw(probs[where], rows, running, gen)
        return tokens, logp


def _draw(probs: torch.Tensor, rows: list[int], running: list[int], gen: torch.Generator | None) -> torch.Tensor:
    """One token per running row (`probs`: theirs, in `running`'s order) from a multinomial draw on
    the shape of all `rows`: the rows that left get a placeholder distribution, so each row reads
    the same noise whichever rows are still there."""
    if len(running) == len(rows):
        return torch.multinomial(probs, num_samples=1, generator=gen).squeeze(1)
    place = {row: k for k, row in enumerate(rows)}
    index = torch.tensor([place[row] for row in running], device=probs.device)
    full = probs.new_zeros((len(rows), probs.shape[-1]))
    full[:, 0] = 1.0  # rows that left: any valid distribution; their draws are not used
    full[index] = probs
    return torch.multinomial(full, num_samples=1, generator=gen).squeeze(1)[index]


@torch.no_grad()
def decode(model, input_ids: torch.Tensor, attention: torch.Tensor, cache, *, budgets: list[int], max_new_tokens: int,
           stop_ids: list[int], pad_id: int, temperature: float | None, top_k: int | None = None, top_p: float = 1.0,
           placement: Placement, extra: dict[str, Any] | None = None, compact: bool = True, keep_states: bool = False,
           stop_rule: Callable[[list[int]], bool] | None = None,
           row_context: Callable[[list[int]], AbstractContextManager] | None = None,
           generators: list[torch.Generator | None] | None = None) -> Decoded:
    """Sample up to `min(budgets[i], max_new_tokens)` tokens for each left-padded row of
    `input_ids` (the first `cache.get_seq_length()` columns already in `cache`, when given).
    `temperature=None`: greedy (logprobs at temperature 1). `extra`: inputs of the first forward
    only (pixels). `keep_states`: return each row's key/values of its prompt's real columns and
    the sampled tokens the model ran (all but the last). `stop_rule`: instead of `stop_ids`, whether
    a row's sampled tokens so far end it (a stop string completed, say); the row keeps that token.
    `row_context(rows)`: entered around each forward with the original rows of the running batch
    (a shared base's per-row adapters follow the rows as they leave). `generators[i]`: where row
    i's random draws come from (see Chooser; None: torch's global generator)."""
    rows, width = input_ids.shape
    device = input_ids.device
    stop_set = set(stop_ids)
    max_new = max(1, min(max_new_tokens, max(budgets)))
    # compact: a row ends at its own budget; else all rows run to the batch's end, as in `generate`
    caps = [max(1, min(b, max_new)) if compact else max_new for b in budgets]
    past = cache.get_seq_length() if cache is not None else 0
    positions = (attention.long().cumsum(-1) - 1).masked_fill(attention == 0, 0)
    mask = None if bool((attention == 1).all()) else attention
    next_position = positions[:, -1]
    inputs = {"input_ids": input_ids[:, past:], "position_ids": positions[:, past:], **(extra or {})}
    keep = logits_kwargs(model)
    chooser = Chooser(rows, temperature, top_k, top_p, generators)
    sampled: list[list[int]] = [[] for _ in range(rows)]
    logprobs: list[list[float]] = [[] for _ in range(rows)]
    states: list[LayerStates | None] = [None] * rows
    stopped = [False] * rows
    batch = list(range(rows))  # the original row of each row of the running batch
    out = Decoded([], [], [])

    def take_states(row: int, at: int) -> None:
        if keep_states and keeps_states(cache):
            ran = max(0, finish(sampled[row], budgets[row], stop_set)[0] - 1)
            columns = torch.cat([attention[row].nonzero().squeeze(-1), torch.arange(width, width + ran, device=device)])
            states[row] = row_states(cache, at, columns)

    # One autocast region for the whole loop: the cast of each float32 trained weight to the compute
    # precision is made at the first step and reused at every later one (a region per step cast every
    # weight again at every token: 37% of a decode step's GPU time in full fine-tuning, profiled).
    with placement.autocast():
        for step in range(max_new):
            with row_context(batch) if row_context else nullcontext():
                result = model(**inputs, attention_mask=mask, past_key_values=cache, use_cache=True, **keep)
            out.forwards += 1
            out.positions += len(batch)
            cache = result.past_key_values
            logits = result.logits[:, -1].float()
            del result
            tokens, logp = chooser(logits, batch)
            chosen = logp.gather(-1, tokens[:, None]).squeeze(-1).tolist()
            token_list = tokens.tolist()
            staying, feed = [], []
            for at, row in enumerate(batch):
                if not stopped[row]:
                    sampled[row].append(token_list[at])
                    logprobs[row].append(chosen[at])
                    stopped[row] = stop_rule(sampled[row]) if stop_rule is not None else token_list[at] in stop_set
                if compact and (stopped[row] or len(sampled[row]) >= caps[row]):
                    take_states(row, at)
                else:
                    staying.append(at)
                    feed.append(pad_id if stopped[row] else token_list[at])
            if not staying or all(stopped) or step + 1 == max_new:
                break
            if len(staying) < len(batch):
                index = torch.tensor(staying, device=device)
                cache.reorder_cache(index)
                next_position = next_position[index]
                mask = mask[index] if mask is not None else None
                batch = [batch[at] for at in staying]
            next_position = next_position + 1
            mask = torch.cat([mask, mask.new_ones((len(batch), 1))], dim=-1) if mask is not None else None
            inputs = {"input_ids": torch.tensor(feed, device=device)[:, None], "position_ids": next_position[:, None]}
    if not compact:  # every row is still in the batch (compacting, each took its states as it left)
        for at, row in enumerate(batch):
            take_states(row, at)
    for row in range(rows):
        n, reason = finish(sampled[row], budgets[row], stop_set)
        if stop_rule is not None:  # a stopped row took no token after its stop
            n, reason = (len(sampled[row]), "stop") if stopped[row] and len(sampled[row]) <= budgets[row] else (min(len(sampled[row]), budgets[row]), "length")
        out.token_ids.append(sampled[row][:n])
        out.logprobs.append(logprobs[row][:n])
        out.finish_reasons.append(reason)
    out.states = states if keep_states else []
    return out
