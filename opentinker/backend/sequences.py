"""What the stream engine decodes (opentinker/backend/stream.py): sequences, the generators they
draw from, and how each next token is chosen.

Sampling: argmax when greedy (logprobs at temperature 1), else a draw from softmax(logits / T)
after top-k and top-p (transformers' warpers, in `generate`'s order; tokens they remove get -inf);
the logprob recorded is that of the distribution the token was drawn from. A draw is the
exponential race torch.multinomial runs, with noise from the row's request's generator; the rows of
one request draw their noise together, on the shape of all of them (`races`), so what a row draws
does not depend on any other request's rows.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable

import torch


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
    versions: list[int] = field(default_factory=list)  # the policy version that drew each token


@dataclass
class Draws:
    """The rows of one request and the generator they draw from (None: torch's global one)."""

    generator: torch.Generator | None
    members: list[Sequence] = field(default_factory=list)
    _places: dict[int, int] = field(default_factory=dict, repr=False)  # id(member) -> its index, filled on first use

    def index(self, seq: Sequence) -> int:
        if len(self._places) != len(self.members):
            self._places = {id(s): k for k, s in enumerate(self.members)}
        return self._places[id(seq)]


@dataclass(eq=False)
class Sequence:
    """One prompt's completion as it is sampled."""

    prompt: list[int]
    params: SamplingParams
    budget: int
    future: Future
    draws: Draws
    stop_rule: Callable[[list[int]], bool] | None = None
    adapter: str | None = None
    images: list[Any] | None = None
    stop_ids: frozenset[int] = frozenset()
    version_of: Callable[[], int] | None = None  # the policy version its tokens are drawn by (a hosted job's own)
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    stopped: bool = False
    slot: int = -1  # its key/value slot, where the engine decodes over slots (slots.py)

    def add(self, token: int, logprob: float, version: int) -> bool:
        """Record a drawn token (by `version`, unless the sequence has its own); whether the sequence ends with it."""
        self.tokens.append(token)
        self.logprobs.append(logprob)
        self.versions.append(self.version_of() if self.version_of is not None else version)
        self.stopped = self.stop_rule(self.tokens) if self.stop_rule is not None else token in self.stop_ids
        return self.stopped or len(self.tokens) >= self.budget


def choose(logits: torch.Tensor, rows: list[Sequence]) -> tuple[list[int], list[float]]:
    """Each row's next token and its logprob under the distribution it was drawn from.

    A sampled row's token is argmax(p / q), q ~ Exp(1) per token (the exponential race, which is
    how torch.multinomial draws one sample, without its three host synchronisations), its q drawn
    from its request's generator (`races`). All rows draw in one pass, whatever their requests, so
    a step costs a few kernels, not a few per row (40 ms a step at batch 128 on an H200, profiled)."""
    n, device = len(rows), logits.device
    logp = torch.empty_like(logits, dtype=torch.float32)
    sampled: list[int] = []
    by_params: dict[Any, list[int]] = {}
    for at, seq in enumerate(rows):
        by_params.setdefault(seq.params, []).append(at)
    for params, ats in by_params.items():
        index = torch.tensor(ats, device=device) if len(ats) < n else None
        scores = logits[index] if index is not None else logits
        if not params.greedy:
            sampled += ats
            if params.temperature != 1.0:
                scores = scores / params.temperature
            for warp in warpers(params):
                scores = warp(None, scores)
        scores = torch.log_softmax(scores.float(), dim=-1)
        if index is None:
            logp = scores
        else:
            logp[index] = scores
    tokens = logp.argmax(-1)
    if sampled:
        sampled.sort()
        index = torch.tensor(sampled, device=device) if len(sampled) < n else None
        probs = (logp[index] if index is not None else logp).exp()
        drawn = (probs / races([rows[at] for at in sampled], probs.shape[-1], device)).argmax(-1)
        if index is None:
            tokens = drawn
        else:
            tokens[index] = drawn
    chosen = logp.gather(-1, tokens[:, None]).squeeze(-1)
    return tokens.tolist(), chosen.tolist()


def races(rows: list[Sequence], vocab: int, device: torch.device) -> torch.Tensor:
    """Exp(1) noise for each row's draw. A request's rows draw theirs together, on the shape of
    all its rows whether they still run or not, so each row reads the same noise whichever of them
    are still there, and nothing another request does moves it."""
    noise, place = [], []
    offsets: dict[int, int] = {}
    at = 0
    for seq in rows:
        draws = seq.draws
        if id(draws) not in offsets:
            offsets[id(draws)] = at
            noise.append(torch.empty((len(draws.members), vocab), device=device).exponential_(1, generator=draws.generator))
            at += len(draws.members)
        place.append(offsets[id(draws)] + draws.index(seq))
    every = torch.cat(noise) if len(noise) > 1 else noise[0]
    return every if place == list(range(len(every))) else every[torch.tensor(place, device=device)]


def warpers(params: Any) -> list[Any]:
    from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

    out = []
    if params.top_k:
        out.append(TopKLogitsWarper(top_k=params.top_k))
    if params.top_p < 1.0:
        out.append(TopPLogitsWarper(top_p=params.top_p))
    return out


def end_of_sequence_ids(tokenizer: Any, eos: int | list[int] | None) -> list[int]:
    """The ids a completion stops at unless told otherwise: the tokenizer's end of sequence and the
    model's generation config's (`eos`: one id, several, or None)."""
    eos = eos if isinstance(eos, list) else [eos] if eos is not None else []
    return sorted({tokenizer.eos_token_id, *eos} - {None})
