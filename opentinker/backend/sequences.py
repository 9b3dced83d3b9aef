"""What the stream engine decodes (opentinker/backend/stream.py): sequences, the generators they
draw from, and how each next token is chosen.

Sampling: argmax when greedy (logprobs at temperature 1), else a draw from softmax(logits / T)
after top-k and top-p (transformers' warpers, in `generate`'s order; tokens they remove get -inf);
the logprob recorded is that of the distribution the token was drawn from. The rows of one
request draw from its generator together, on the shape of all of them (`draw`), so what a row
draws does not depend on any other request's rows.
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

    def add(self, token: int, logprob: float, version: int) -> bool:
        """Record a drawn token (by `version`, unless the sequence has its own); whether the sequence ends with it."""
        self.tokens.append(token)
        self.logprobs.append(logprob)
        self.versions.append(self.version_of() if self.version_of is not None else version)
        self.stopped = self.stop_rule(self.tokens) if self.stop_rule is not None else token in self.stop_ids
        return self.stopped or len(self.tokens) >= self.budget


def choose(logits: torch.Tensor, rows: list[Sequence]) -> tuple[list[int], list[float]]:
    """Each row's next token and its logprob under the distribution it was drawn from."""
    tokens = torch.zeros(len(rows), dtype=torch.long, device=logits.device)
    chosen = torch.zeros(len(rows), dtype=torch.float32, device=logits.device)
    by_params: dict[Any, list[int]] = {}
    for at, seq in enumerate(rows):
        by_params.setdefault(seq.params, []).append(at)
    logps: dict[int, torch.Tensor] = {}
    for params, ats in by_params.items():
        index = torch.tensor(ats, device=logits.device)
        scores = logits[index]
        if params.greedy:
            picked = scores.argmax(-1)
            tokens[index] = picked
            chosen[index] = torch.log_softmax(scores, -1).gather(-1, picked[:, None]).squeeze(-1)
            continue
        if params.temperature != 1.0:
            scores = scores / params.temperature
        for warp in warpers(params):
            scores = warp(None, scores)
        logp = torch.log_softmax(scores, dim=-1)
        for k, at in enumerate(ats):
            logps[at] = logp[k]
    by_draws: dict[int, list[int]] = {}
    for at in logps:
        by_draws.setdefault(id(rows[at].draws), []).append(at)
    for ats in by_draws.values():
        draws = rows[ats[0]].draws
        members = {id(s): k for k, s in enumerate(draws.members)}
        probs = torch.stack([logps[at] for at in ats]).exp()
        picked = draw(probs, list(range(len(draws.members))), [members[id(rows[at])] for at in ats], draws.generator)
        index = torch.tensor(ats, device=logits.device)
        tokens[index] = picked
        chosen[index] = torch.stack([logps[at][t] for at, t in zip(ats, picked.tolist())])
    return tokens.tolist(), chosen.tolist()



def draw(probs: torch.Tensor, rows: list[int], running: list[int], gen: torch.Generator | None) -> torch.Tensor:
    """One token per running row (`probs`: theirs, in `running`'s order) from a multinomial draw on
    the shape of all `rows` of one generator: the rows not running get a placeholder distribution,
    so each row reads the same noise whichever of them are still there."""
    if len(running) == len(rows):
        return torch.multinomial(probs, num_samples=1, generator=gen).squeeze(1)
    place = {row: k for k, row in enumerate(rows)}
    index = torch.tensor([place[row] for row in running], device=probs.device)
    full = probs.new_zeros((len(rows), probs.shape[-1]))
    full[:, 0] = 1.0  # rows not running: any valid distribution; their draws are not used
    full[index] = probs
    return torch.multinomial(full, num_samples=1, generator=gen).squeeze(1)[index]


def warpers(params: Any) -> list[Any]:
    from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

    out = []
    if params.top_k:
        out.append(TopKLogitsWarper(top_k=params.top_k))
    if params.top_p < 1.0:
        out.append(TopPLogitsWarper(top_p=params.top_p))
    return out
