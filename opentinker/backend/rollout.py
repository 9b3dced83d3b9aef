"""Rollout engines: prompts as token ids in, sampled token ids with their logprobs out.

`RolloutEngine` is the interface the agent loop calls; `HFRolloutEngine` implements it with
batched decoding over a transformers model (KV cache). A vLLM engine implements the same two
members. Logprobs are those of the distribution each token was drawn from: softmax(logits / T)
by default (no truncation: the policy the trainer scores), or, when top-k or top-p is asked for,
the processed one (truncated and renormalised, as vLLM's `processed_logprobs`), so the ratios of
the update are taken against the behaviour policy that really sampled.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from opentinker.backend.decode import decode
from opentinker.backend.device import Placement
from opentinker.backend.prefix_cache import PrefixCache
from opentinker.model.vision import pixel_batch


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 24
    temperature: float = 1.0
    top_p: float = 1.0
    greedy: bool = False
    # None: no truncation (transformers' `generate` would keep 50 tokens unless told otherwise; this
    # engine never truncates unless asked). With top_k or top_p < 1 the recorded logprobs are the
    # truncated, renormalised distribution's.
    top_k: int | None = None


@dataclass
class Completion:
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop": ended with an end-of-turn token; "length": hit its token budget


class RolloutEngine(Protocol):
    policy_version: int

    def generate(self, prompts: list[list[int]], params: SamplingParams, budgets: list[int] | None = None,
                 images: list[list[Any]] | None = None) -> list[Completion]:
        """One completion per prompt; `budgets[i]` caps prompt i's new tokens below max_new_tokens;
        `images[i]`: the VisualInputs of prompt i's record (a vision-language policy)."""
        ...


@torch.no_grad()
def score_tokens(model, placement: Placement, prompt: list[int], tokens: list[int]) -> list[float]:
    """The logprobs (temperature 1) `model` gives `tokens` after `prompt`: the trainer's side of a
    check that another engine samples from the same weights."""
    ids = torch.tensor([prompt + tokens], device=placement.device)
    was_training = model.training
    model.eval()
    try:
        with placement.autocast():
            logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
    finally:
        model.train(was_training)
    target = torch.tensor(tokens, device=logits.device)[:, None]
    return torch.log_softmax(logits, dim=-1).gather(-1, target).squeeze(-1).tolist()


class HFRolloutEngine:
    """Batched decoding with left padding (opentinker/backend/decode.py: a row leaves the batch
    when its completion ends); per-token logprobs from the raw logits.
    The next turn of an episode reuses the key/values of its record so far (`PrefixCache`), so
    a turn prefills only its observation; `prefix_cache_tokens=0` turns that off."""

    def __init__(self, model, tokenizer, max_batch_size: int = 64, prefix_cache_tokens: int = 65536, placement: Placement | None = None,
                 early_stop: bool = True):
        self.model = model
        self.placement = placement or Placement(model.device, torch.float32)
        self.tokenizer = tokenizer
        self.max_batch_size = max_batch_size
        self.prefix_cache = PrefixCache(model, prefix_cache_tokens)
        self.policy_version = 0
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        eos = model.generation_config.eos_token_id if model.generation_config is not None else None
        eos = eos if isinstance(eos, list) else [eos] if eos is not None else []
        self.stop_ids = sorted({tokenizer.eos_token_id, *eos} - {None})
        self.generated_tokens = 0
        self.generate_seconds = 0.0
        # Decode cost: forward passes, and batch rows summed over them (next-token distributions
        # computed), against the positions whose token a completion kept. With `early_stop` a row
        # leaves the batch right after its last kept token, so the two position counts are equal;
        # without it every row runs until the batch's longest one ends, as in `model.generate`.
        self.early_stop = early_stop
        self.row_scope: Callable[[list[str | None]], Any] | None = None  # a shared base's `rows(names)`: per-row adapters
        self.decode_forwards = 0
        self.decode_positions = 0
        self.useful_positions = 0

    def end_phase(self) -> None:
        """The phase's episodes are over: free their cached states (dead now, and they slow the update)."""
        self.prefix_cache.clear()

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], params: SamplingParams, budgets: list[int] | None = None,
                 images: list[list[Any]] | None = None, stop_rule: Callable[[list[int]], bool] | None = None,
                 adapters: list[str | None] | None = None, generators: list[torch.Generator | None] | None = None) -> list[Completion]:
        """`stop_rule`: when a completion ends, in place of the end-of-turn tokens (see decode).
        `adapters`: each prompt's adapter on a shared base (through `row_scope`; no prefix cache).
        `generators`: each prompt's random generator (see decode.Chooser; None: torch's global one)."""
        budgets = budgets or [params.max_new_tokens] * len(prompts)
        if adapters is not None and (self.row_scope is None or self.prefix_cache.max_tokens):
            raise ValueError("per-row adapters need a shared base's row_scope and no prefix cache")
        # Similar lengths together waste less padding; results go back in the caller's order.
        order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
        results: dict[int, Completion] = {}
        for start in range(0, len(order), self.max_batch_size):
            chunk = order[start : start + self.max_batch_size]
            pictures = [images[i] for i in chunk] if images is not None and any(images[i] for i in chunk) else None
            names = [adapters[i] for i in chunk] if adapters is not None else None
            draws = [generators[i] for i in chunk] if generators is not None else None
            for i, c in zip(chunk, self._generate_batch([prompts[i] for i in chunk], params, [budgets[i] for i in chunk], pictures, stop_rule,
                                                        names, draws)):
                results[i] = c
        return [results[i] for i in range(len(prompts))]

    @torch.no_grad()
    def _shared_prefill(self, prompts: list[list[int]], input_ids: torch.Tensor, attention: torch.Tensor,
                        names: list[str | None] | None = None):
        """Samples of one group share their prompt: run each distinct prompt (of one adapter) once
        (all but its last token) and give every row a copy of its prompt's KV cache. Saves
        (group_size-1)/group_size of the prompt compute; returns None when no prompt repeats."""
        first_row: dict[tuple[Any, ...], int] = {}
        index = [first_row.setdefault((tuple(p), names[i] if names else None), len(first_row)) for i, p in enumerate(prompts)]
        if len(first_row) == len(prompts) or input_ids.shape[1] < 2:
            return None
        firsts = [index.index(u) for u in range(len(first_row))]
        rows = torch.tensor(firsts, device=input_ids.device)
        ids, attn = input_ids[rows, :-1], attention[rows, :-1]
        position_ids = (attn.cumsum(-1) - 1).clamp(min=0)
        with self.placement.autocast(), (self.row_scope([names[i] for i in firsts]) if names else nullcontext()):
            out = self.model(input_ids=ids, attention_mask=attn, position_ids=position_ids, use_cache=True)
        cache = out.past_key_values
        cache.reorder_cache(torch.tensor(index, device=input_ids.device))
        return cache

    def _generate_batch(self, prompts: list[list[int]], params: SamplingParams, budgets: list[int],
                        images: list[list[Any]] | None = None, stop_rule: Callable[[list[int]], bool] | None = None,
                        names: list[str | None] | None = None, generators: list[torch.Generator | None] | None = None) -> list[Completion]:
        t0 = time.perf_counter()
        device = self.placement.device
        # Records with images prefill whole (their pixels enter at their image tokens), unshared and uncached.
        hits = self.prefix_cache.lookup(prompts) if images is None else [(0, None)] * len(prompts)
        pixels = pixel_batch(images, device) if images is not None else {}
        if any(n for n, _ in hits):
            input_ids, attention, cache = self._continue_cached(prompts, hits)
            input_ids, attention = input_ids.to(device), attention.to(device)
        else:
            input_ids, attention = self._left_padded(prompts)
            input_ids, attention = input_ids.to(device), attention.to(device)
            cache = self._shared_prefill(prompts, input_ids, attention, names) if images is None else None
        was_training = self.model.training
        self.model.eval()
        try:
            out = decode(self.model, input_ids, attention, cache, budgets=budgets, max_new_tokens=params.max_new_tokens,
                         stop_ids=self.stop_ids, pad_id=self.pad_id, temperature=None if params.greedy else params.temperature,
                         top_k=params.top_k, top_p=params.top_p, placement=self.placement, extra=pixels, compact=self.early_stop,
                         keep_states=images is None and bool(self.prefix_cache.max_tokens) and stop_rule is None, stop_rule=stop_rule,
                         row_context=(lambda rows: self.row_scope([names[r] for r in rows])) if names else None, generators=generators)
        finally:
            self.model.train(was_training)
        completions = [Completion(ids, lps, reason) for ids, lps, reason in zip(out.token_ids, out.logprobs, out.finish_reasons)]
        useful = sum(len(c.token_ids) for c in completions)
        self.generated_tokens += useful
        self.decode_forwards += out.forwards
        self.decode_positions += out.positions
        self.useful_positions += useful
        for prompt, comp, states in zip(prompts, completions, out.states):
            # a row's states: its prompt's real columns, then the sampled tokens the model ran (all but the last)
            if states is not None:
                self.prefix_cache.store(prompt + comp.token_ids[: max(0, len(comp.token_ids) - 1)], states)
        self.generate_seconds += time.perf_counter() - t0
        return completions

    def _left_padded(self, prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        width = max(len(p) for p in prompts)
        input_ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        attention = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, p in enumerate(prompts):
            input_ids[row, width - len(p) :] = torch.tensor(p, dtype=torch.long)
            attention[row, width - len(p) :] = 1
        return input_ids, attention

    def _continue_cached(self, prompts: list[list[int]], hits) -> tuple[torch.Tensor, torch.Tensor, Any]:
        """Inputs whose first C columns are already in the returned cache: row by row, the cached
        prefix right-aligned in [0, C) and the rest of the prompt right-aligned in [C, C + D), with
        padding masked out in both (positions come from the mask, so they continue the prefix)."""
        from transformers import DynamicCache

        cached = max(n for n, _ in hits)
        rest = max(len(p) - n for p, (n, _) in zip(prompts, hits))
        states = next(s for _, s in hits if s is not None)
        rows = len(prompts)
        input_ids = torch.full((rows, cached + rest), self.pad_id, dtype=torch.long)
        attention = torch.zeros((rows, cached + rest), dtype=torch.long)
        layers = [(k.new_zeros((rows, k.shape[0], cached, k.shape[2])), v.new_zeros((rows, v.shape[0], cached, v.shape[2])))
                  for k, v in states]
        for row, (p, (n, row_states)) in enumerate(zip(prompts, hits)):
            tail = p[n:]
            input_ids[row, cached - n : cached] = torch.tensor(p[:n], dtype=torch.long)
            input_ids[row, cached + rest - len(tail) :] = torch.tensor(tail, dtype=torch.long)
            attention[row, cached - n : cached] = 1
            attention[row, cached + rest - len(tail) :] = 1
            for (keys, values), (k, v) in zip(layers, row_states or []):
                keys[row, :, cached - n :] = k
                values[row, :, cached - n :] = v
        return input_ids, attention, DynamicCache(ddp_cache_data=layers)
