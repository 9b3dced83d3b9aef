"""Rollout engines: prompts as token ids in, sampled token ids with their logprobs out.

`RolloutEngine` is the interface the agent loop calls, from many threads at once (each episode
on its own); `HFRolloutEngine` implements it with continuous batching over a transformers model
(KV cache; opentinker/backend/stream.py). A vLLM engine implements the same two members.
Logprobs are those of the distribution each token was drawn from: softmax(logits / T) by default (no truncation: the policy the trainer scores), or, when top-k or top-p is asked for,
the processed one (truncated and renormalised, as vLLM's `processed_logprobs`), so the ratios of
the update are taken against the behaviour policy that really sampled.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch

from opentinker.backend.device import Placement
from opentinker.backend.sequences import Completion, SamplingParams  # noqa: F401 - the engines' vocabulary, imported from here too


class RolloutEngine(Protocol):
    policy_version: int

    def generate(self, prompts: list[list[int]], params: SamplingParams, budgets: list[int] | None = None,
                 images: list[list[Any]] | None = None, generators: list[torch.Generator | None] | None = None) -> list[Completion]:
        """One completion per prompt, callable from many threads at once; `budgets[i]` caps prompt
        i's new tokens below max_new_tokens; `images[i]`: the VisualInputs of prompt i's record (a
        vision-language policy); `generators[i]`: where prompt i's draws come from (an episode's)."""
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
    """A transformers model as a rollout engine: `generate` submits its prompts to a continuous
    batching engine (opentinker/backend/stream.py) and waits for them, so calls from many threads
    (an agent loop's episodes, each on its own) decode in one running batch that sequences join and
    leave at every step. A row leaves the batch the moment its completion ends, and the next turn of
    an episode reuses the key/values of its record so far (`PrefixCache`: a turn prefills only its
    observation; `prefix_cache_tokens=0` turns that off)."""

    def __init__(self, model, tokenizer, max_batch_size: int = 64, prefix_cache_tokens: int = 65536, placement: Placement | None = None,
                 run_step: Callable[..., Any] | None = None, row_scope: Callable[[list[str | None]], Any] | None = None,
                 admits: Callable[..., bool] | None = None, before_admit: Callable[..., Any] | None = None, slots: bool | None = None):
        """`run_step`, `row_scope`, `admits`, `before_admit`, `slots`: see StreamEngine."""
        from opentinker.backend.stream import StreamEngine

        self.tokenizer = tokenizer
        self.placement = placement or Placement(model.device, torch.float32)
        self.stream = StreamEngine(model, tokenizer, self.placement, max_batch_size, prefix_cache_tokens, row_scope, run_step, admits,
                                   before_admit, slots)

    # -- what callers read and set -----------------------------------------------------------
    @property
    def model(self):
        return self.stream.model

    @model.setter
    def model(self, model) -> None:  # an engine that wraps its model later (peft adapters loaded by name)
        self.stream.between_steps(lambda: setattr(self.stream, "model", model))

    @property
    def prefix_cache(self):
        return self.stream.prefix_cache

    @property
    def stop_ids(self) -> list[int]:
        return self.stream.stop_ids

    @stop_ids.setter
    def stop_ids(self, ids: list[int]) -> None:
        self.stream.stop_ids = list(ids)

    @property
    def policy_version(self) -> int:
        return self.stream.policy_version

    @policy_version.setter
    def policy_version(self, version: int) -> None:
        self.stream.policy_version = version

    @property
    def max_batch_size(self) -> int:
        return self.stream.max_batch_size

    @property
    def pad_id(self) -> int:
        return self.stream.pad_id

    # counters: tokens kept, seconds the engine computed, forwards and the rows they ran
    generated_tokens = property(lambda self: self.stream.generated_tokens)
    generate_seconds = property(lambda self: self.stream.busy_seconds)
    decode_forwards = property(lambda self: self.stream.decode_forwards)
    decode_positions = property(lambda self: self.stream.decode_positions)
    useful_positions = property(lambda self: self.stream.useful_positions)

    def end_phase(self) -> None:
        """The phase's episodes are over: free their cached states (dead now, and they slow the update)."""
        self.stream.between_steps(self.stream.prefix_cache.clear)

    def close(self) -> None:
        self.stream.close()

    def generate(self, prompts: list[list[int]], params: SamplingParams, budgets: list[int] | None = None,
                 images: list[list[Any]] | None = None, stop_rule: Callable[[list[int]], bool] | None = None,
                 adapters: list[str | None] | None = None, generators: list[torch.Generator | None] | None = None) -> list[Completion]:
        """One completion per prompt. `stop_rule`: when a completion ends, in place of the
        end-of-turn tokens. `adapters`: each prompt's adapter on a shared base (through `row_scope`).
        `generators[i]`: the generator prompt i draws from; prompts given one generator object draw
        together (a request's rows), every other prompt from one of its own seeded from torch's
        global generator (so a seeded process replays)."""
        budgets = budgets or [params.max_new_tokens] * len(prompts)
        groups: dict[int, list[int]] = {}
        for i in range(len(prompts)):
            gen = generators[i] if generators is not None else None
            groups.setdefault(id(gen) if gen is not None else -1 - i, []).append(i)
        seqs: dict[int, Any] = {}
        for members in groups.values():
            gen = generators[members[0]] if generators is not None else None
            request = self.stream.sequences([prompts[i] for i in members], params, [budgets[i] for i in members], stop_rule=stop_rule,
                                            generator=gen, adapters=[adapters[i] for i in members] if adapters is not None else None,
                                            images=[images[i] for i in members] if images is not None else None)
            seqs.update(zip(members, request))
        self.stream.enqueue([seqs[i] for i in range(len(prompts))])  # one call's prompts join together
        return [seqs[i].future.result() for i in range(len(prompts))]
