"""A training client's calls in seq_id order, the SDK's retries told from a second client, and
the bound on a forward(_backward) call's tokens.

The SDK numbers a training client's calls (seq_id 1, 2, …) and sends the next only once the last
was accepted; the chunks of one forward_backward travel together, the first one last. So the
session runs a model's calls in seq_id order (Sequencer), answers a resend of the same body with
the first request's id, and fails any other reuse of a seq_id (Replays): a second client driving
the same model is told so in one line, never answered with another request's result.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable

log = logging.getLogger("opentinker.tinker")

GAP_WAIT_S = 60.0  # a missing seq_id holds later calls this long, then they run (the client may have given it up)


def failed(future: Future, line: str) -> None:
    """Complete `future` with a user error, as a call that failed in its turn does."""
    if not future.done():
        future.set_result({"error": line, "category": "user"})


@dataclass
class Queued:
    """A call waiting for its turn: `run` computes it into `future`; a forward(_backward) counts its tokens."""

    run: Callable[[], None]
    future: Future
    op: str
    tokens: int = 0
    arrived: float = field(default_factory=time.monotonic)

    def refuse(self, line: str) -> None:
        """It fails now (its turn then does nothing)."""
        failed(self.future, line)
        self.run = lambda: None


class Sequencer:
    """Runs a model's calls one at a time in seq_id order on its own thread, and holds a
    forward(_backward) call to `max_call_tokens` tokens (None: no bound).

    A call of the SDK's forward_backward arrives as chunks with consecutive seq_ids, its first
    chunk last (the others wait for it, its seq_id being the gap they wait on): the chunks waiting
    together are one call. One over the bound fails at once with the numbers, every chunk of it,
    the first one too when it comes; nothing of it runs.
    """

    def __init__(self, name: str, max_call_tokens: int | None = None):
        self.next = 1
        self.waiting: dict[int, Queued] = {}
        self.max_call_tokens = max_call_tokens
        self.over: tuple[int, str] | None = None  # (seq_id of an over-bound call's first chunk, still to come; why)
        self.lock = threading.Lock()
        self.executor = ThreadPoolExecutor(1, thread_name_prefix=f"tinker-{name}")

    def submit(self, seq_id: int, call: Queued) -> None:
        with self.lock:
            if call.op == "forward_backward":
                self._bound(seq_id, call)
            if seq_id <= 0 or seq_id < self.next:  # unnumbered, or after its gap was given up: runs now
                self.executor.submit(call.run)
                return
            self.waiting[seq_id] = call
            self._drain()

    def skip(self, seq_id: int) -> None:
        """`seq_id` will never come (the gateway refused it): later calls stop waiting for it."""
        with self.lock:
            if seq_id >= self.next and seq_id not in self.waiting:
                self.waiting[seq_id] = Queued(lambda: None, Future(), "refused")
                self._drain()

    def _bound(self, seq_id: int, call: Queued) -> None:
        """Refuse `call`, and the chunks of its call waiting beside it, when together they hold more than the bound."""
        if self.over is not None and seq_id >= self.over[0]:  # a chunk of a call refused already
            call.refuse(self.over[1])
            if seq_id == self.over[0]:
                self.over = None
            return
        if self.max_call_tokens is None:
            return
        chunks = [call] + [self.waiting[s] for s in self._chunks_beside(seq_id)]
        total = sum(c.tokens for c in chunks)
        if total <= self.max_call_tokens:
            return
        line = (f"forward_backward: a call of {total:,} tokens (or more) is over this server's bound of {self.max_call_tokens:,} "
                "tokens a call (OPENTINKER_TINKER_MAX_CALL_TOKENS); send it as calls of at most that many (gradients add up "
                "until optim_step)")
        for chunk in chunks:
            chunk.refuse(line)
        if seq_id > self.next:  # its first chunk is still to come (the SDK sends it last)
            self.over = (self.next, line)

    def _chunks_beside(self, seq_id: int) -> list[int]:
        """The waiting forward(_backward)s with seq_ids next to `seq_id`, both ways, as far as they run."""
        found = []
        for step in (-1, 1):
            s = seq_id + step
            while s in self.waiting and self.waiting[s].op == "forward_backward":
                found.append(s)
                s += step
        return found

    def _drain(self) -> None:
        while self.next in self.waiting:
            self.executor.submit(self.waiting.pop(self.next).run)
            self.next += 1

    def tick(self) -> None:
        """Give up a gap that held later calls longer than GAP_WAIT_S."""
        with self.lock:
            if self.waiting and min(c.arrived for c in self.waiting.values()) < time.monotonic() - GAP_WAIT_S:
                log.warning("seq_id %d never arrived: running %d later call(s)", self.next, len(self.waiting))
                self.next = min(self.waiting)
                self.over = None
                self._drain()

    def close(self) -> None:
        """Calls still waiting never run (the model is gone); the one running finishes or fails."""
        with self.lock:
            for call in self.waiting.values():
                call.refuse("the session ended before this call's turn")
            self.waiting.clear()
        self.executor.shutdown(wait=False, cancel_futures=True)


@dataclass
class Seen:
    """What a (model, seq_id) was first used for: its request, the digest of its body, its call,
    and the model's highest seq_ids at that moment (Latest)."""

    request_id: str
    digest: str
    op: str
    then: Latest


@dataclass(frozen=True)
class Latest:
    """A model's highest seq_id so far, of any call and of a call other than forward(_backward)."""

    any: int = 0
    other: int = 0

    def after(self, seq_id: int, op: str) -> Latest:
        return Latest(max(self.any, seq_id), max(self.other, seq_id) if op != "forward_backward" else self.other)


class Replays:
    """What each (model, seq_id) was first used for, to tell the SDK's retries from a second client."""

    def __init__(self) -> None:
        self.seen: dict[tuple[str, int], Seen] = {}
        self.latest: dict[str, Latest] = {}  # per model, its highest seq_ids so far
        self.lock = threading.Lock()

    def check(self, model_id: str, seq_id: int, op: str, digest: str, request_id: str) -> tuple[str | None, str | None]:
        """(the first request's id: a retry, or None; why it fails: a second client, or None).
        Neither: a new call, recorded under `request_id`."""
        if seq_id <= 0:
            return None, None
        with self.lock:
            seen = self.seen.get((model_id, seq_id))
            now = self.latest.get(model_id, Latest())
            if seen is None:
                self.seen[(model_id, seq_id)] = Seen(request_id, digest, op, now)
                self.latest[model_id] = now.after(seq_id, op)
                return None, None
        why = self._second_client(model_id, seq_id, seen, op, digest, now)
        return (seen.request_id, None) if why is None else (None, why)

    @staticmethod
    def _second_client(model_id: str, seq_id: int, seen: Seen, op: str, digest: str, now: Latest) -> str | None:
        """Why a repeated seq_id is not the SDK's retry, or None when it is one. The SDK sends a
        training client's next call only once this one was accepted, so a retry comes before any
        call with a later seq_id arrives after it (the chunks of one forward_backward travel
        together: for those, before a later call of another kind)."""
        rule = ("a training client takes its calls from one TrainingClient at a time (to go on elsewhere: save_state, then "
                "create_training_client_from_state in the other process)")
        if seen.digest != digest:
            return f"seq_id {seq_id} of {model_id} was used already by another request ({seen.op}, a different body): {rule}"
        later, before = (now.other, seen.then.other) if op == "forward_backward" else (now.any, seen.then.any)
        if later > seq_id and later > before:  # a later call came after this one had been accepted
            return f"seq_id {seq_id} of {model_id} was answered already and later calls followed it: {rule}"
        return None
