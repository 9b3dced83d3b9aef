"""What a shared base's runner runs (opentinker.backend.shared_base), and in whose turn.

A training client's forward(_backward) call is a `TinkerCall`, run in pieces of at most a pass's
tokens; a hosted job's micro-batch is a `JobPass`, run whole. `Turns` holds each tenant's calls in
the order they came and the tenants in turn: the next pass is led by the next tenant that has work
queued (round-robin), so a tenant waits for at most one piece of each neighbour's work.
"""

from __future__ import annotations

import queue
from collections import OrderedDict, deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch

from opentinker.backend.primitives import BadRequest
from opentinker.core.spec_limits import SHARED_PASS_TOKENS

JOINT_PASS_TOKENS = 4 * SHARED_PASS_TOKENS  # most padded positions of one joint pass (hosted jobs' micro-batches; a GPU's passes)


@dataclass
class TinkerCall:
    """A training client's forward(_backward) call. Its rows run in pieces of at most a pass's
    tokens (shortest first), each piece in a pass of its own or, where passes are joint, beside
    other tenants' pieces; its outputs, metric sums and token count gather across the pieces."""

    adapter: str
    rows: list[dict[str, torch.Tensor]]
    loss_fn: str
    config: dict[str, float]
    forward_only: bool
    future: Future = field(default_factory=Future)
    tenant: str = ""  # whose turn it takes (round-robin between tenants); default: its adapter's
    todo: list[int] = field(init=False)  # rows not run yet, shortest first
    outputs: list[dict[str, np.ndarray]] = field(init=False)
    sums: dict[str, float] = field(default_factory=dict)
    tokens: float = 0.0
    before: list[torch.Tensor | None] | None = None  # its adapter's gradient before its first piece (put back if it fails)

    def __post_init__(self) -> None:
        self.tenant = self.tenant or self.adapter
        self.todo = sorted(range(len(self.rows)), key=lambda i: len(self.rows[i]["tokens"]))
        self.outputs = [{} for _ in self.rows]

    @property
    def kind(self) -> str:
        return "forward" if self.forward_only else "train"

    @property
    def started(self) -> bool:
        return len(self.todo) < len(self.rows)

    def take(self, budget: int) -> list[int]:
        """The next rows to run: as many (shortest first) as pad to at most `budget` tokens, one at least."""
        piece: list[int] = []
        while self.todo and not (piece and len(self.rows[self.todo[0]]["tokens"]) * (len(piece) + 1) > budget):
            piece.append(self.todo.pop(0))
        return piece


@dataclass
class JobPass:
    """One micro-batch of a hosted job's update (opentinker.backend.trainer): right-padded rows and
    `loss(logits) -> (loss, statistics)`, `logits` its rows' head outputs at their loss positions
    in row-major order (as the trainer selects them). One piece: it runs whole."""

    adapter: str
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    loss_mask: torch.Tensor
    loss: Callable[[torch.Tensor], tuple[torch.Tensor, dict[str, float]]]
    future: Future = field(default_factory=Future)
    forward_only = False
    kind = "job"
    started = False

    @property
    def tenant(self) -> str:
        return self.adapter


Piece = tuple[Any, list[int]]  # a call and the rows of it a pass runs (a job's micro-batch: all of it)


def overfills(batch: list[Any], call: Any) -> bool:
    """Would `call` take a joint pass of hosted jobs' micro-batches past JOINT_PASS_TOKENS padded
    positions? (A pass's first call always runs.)"""
    if call.kind != "job" or not batch:
        return False
    parts = [*batch, call]
    return max(c.input_ids.shape[1] for c in parts) * sum(c.input_ids.shape[0] for c in parts) > JOINT_PASS_TOKENS


@dataclass
class PassStats:
    """What the runner did: passes run, pieces of calls in them, how many passes held two adapters
    or more, and how many shared passes failed and ran as each piece alone (a count above 0 where
    every call then succeeded is the runtime's fault, not a tenant's: a bf16 base once failed them all)."""

    passes: int = 0
    calls: int = 0
    shared: int = 0
    split: int = 0

    def share(self) -> float:
        return self.shared / self.passes if self.passes else 0.0


class Turns:
    """Each tenant's calls in the order they came, and the tenants in turn."""

    def __init__(self, base_name: str):
        self.base_name = base_name
        self.queues: OrderedDict[str, deque[Any]] = OrderedDict()

    def admit(self, calls: queue.Queue, timeout: float | None = 0.0) -> bool:
        """Queue every call that has arrived (`calls`) under its tenant, waiting up to `timeout`
        seconds for the first (None: until one comes); False once the base closes (a None in
        `calls`): every call queued then fails."""
        try:
            call = calls.get(timeout=timeout) if timeout is None or timeout > 0 else calls.get_nowait()
        except queue.Empty:
            return True
        while call is not None:
            self.queues.setdefault(call.tenant, deque()).append(call)
            try:
                call = calls.get_nowait()
            except queue.Empty:
                return True
        for waiting in (c for tenant_calls in self.queues.values() for c in tenant_calls):
            waiting.future.set_exception(BadRequest(f"the base {self.base_name} closed while the call waited"))
        self.queues.clear()
        return False

    def heads(self) -> list[Any]:
        """The first call of each tenant that has one, in turn order."""
        return [calls[0] for calls in self.queues.values() if calls]

    def next(self, calls: queue.Queue) -> Any | None:
        """The call that leads the next pass (its tenant goes to the back of the turn), waiting for
        one to come; None once the base closes."""
        while self.admit(calls, timeout=None if not self.heads() else 0.0):
            heads = self.heads()
            if heads:
                self.queues.move_to_end(heads[0].tenant)
                return heads[0]
        return None

    def done(self, call: Any) -> None:
        """The call leaves its tenant's queue (it is that queue's first)."""
        tenant_calls = self.queues.get(call.tenant)
        if tenant_calls and tenant_calls[0] is call:
            tenant_calls.popleft()
