"""Calls to the job's endpoint joined into token-exact records (the third door: the user's own agent).

A harness that talks to an OpenAI-compatible endpoint sends the whole conversation again at every
call, as messages; the endpoint renders them to tokens. The record of an episode must hold the tokens
that were sampled, with the logprobs they were sampled with, not a re-tokenisation of their text. So
calls are joined by their token ids only:

- a call whose rendered prompt starts with an earlier record's tokens, all of them, continues that
  record: what the prompt adds (the tool's answer, the next user turn, the template's separators) is
  context (loss mask 0), what it sampled is trained (mask 1, its logprobs, its policy version);
- a call whose prompt differs from a record at a token the policy sampled re-rendered that answer
  differently (a template that trims whitespace, drops a separator or the thinking): the drift that
  makes trained tokens differ from sampled ones. It is counted and said in one line, and the call
  becomes a record of its own, never a join that trains tokens nobody sampled;
- any other call (a new conversation, a retry of the same prompt, a history the harness rewrote
  before its last answer) starts a record of its own, no drift.

Records of different chat templates (their hash) never join.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from opentinker.backend.shared_prefix import common_prefix_length
from opentinker.core.trajectory import Trajectory


@dataclass(frozen=True)
class RecordedCall:
    """One answered call, as the endpoint saw it: the rendered prompt, the sampled answer and its
    logprobs, the policy version that drew it, the template's hash, and the answer's text."""

    prompt_ids: list[int]
    sampled_ids: list[int]
    logprobs: list[float]
    policy_version: int = 0
    template_hash: str = ""
    text: str = ""


@dataclass
class JoinedCalls:
    """An episode's calls as records; `drifted` counts calls whose prompt changed sampled tokens
    (one line each in `drift`)."""

    records: list[Trajectory] = field(default_factory=list)
    drifted: int = 0
    drift: list[str] = field(default_factory=list)


def join_calls(calls: Sequence[RecordedCall]) -> JoinedCalls:
    """The calls of one episode, in the order they were answered, joined (see the module)."""
    out = JoinedCalls()
    hashes: list[str] = []  # each record's template hash
    for k, call in enumerate(calls):
        if len(call.sampled_ids) != len(call.logprobs):
            raise ValueError(f"call {k}: {len(call.sampled_ids)} sampled token(s) but {len(call.logprobs)} logprob(s)")
        best, reach = None, -1
        for j, record in enumerate(out.records):
            if hashes[j] != call.template_hash:
                continue
            shared = common_prefix_length([record.token_ids, call.prompt_ids])
            if shared >= reach:  # ties go to the latest record
                best, reach = j, shared
        record = out.records[best] if best is not None else None
        if record is not None and reach == len(record.token_ids):
            record.append_observation(list(call.prompt_ids[reach:]), observation="")
        else:
            if record is not None and reach < len(call.prompt_ids) and record.loss_mask[reach]:
                out.drifted += 1
                out.drift.append(f"call {k} re-rendered a sampled token of record {best} at position {reach} "
                                 f"(sampled {record.token_ids[reach]}, the prompt has {call.prompt_ids[reach]}): trained as a record of its own")
            record = Trajectory(prompt_ids=list(call.prompt_ids), policy_version=call.policy_version)
            out.records.append(record)
            hashes.append(call.template_hash)
        record.append_sampled(list(call.sampled_ids), list(call.logprobs), call.text,
                              versions=[call.policy_version] * len(call.sampled_ids))
    return out
