"""A job's inference servers as one rollout engine: requests shared by load, weights on every one.

A job may sample through several servers of its own (`rollout.servers`: one per GPU, or several
sharing a CPU's cores). Each request goes to the server with the fewest of the job's requests in
flight (ties in turn), so a slow or busy one takes less. After every update the new version is
read from the trainer once and moved onto each server concurrently, and each is verified on its
own (its probe against the trainer's logprobs, its stamp for weights taken in place): a version
counts as synced only once every server holds it, and one server's SyncError fails the sync. A
server that dies names itself in the ServerGone line (`inference server 2 of 3 at …`); `restart`
starts new ones in place of the dead, leaving the live ones as they are.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any

import torch

from opentinker.backend.rollout import Completion, SamplingParams
from opentinker.backend.server_engine import Probe, ServerHandle, ServerRolloutEngine

__all__ = ["ServerPool"]


def _label(index: int, count: int) -> str:
    return "the inference server" if count == 1 else f"inference server {index + 1} of {count}"


class ServerPool:
    """`RolloutEngine` over the job's servers, with `ServerRolloutEngine`'s sync API."""

    def __init__(self, servers: list[ServerHandle], tolerance: float):
        if not servers:
            raise ValueError("a server pool needs at least one server")
        self.tolerance = tolerance
        self.members = [self._engine(s, i, len(servers)) for i, s in enumerate(servers)]
        self._lock = threading.Lock()
        self._in_flight = [0] * len(servers)  # the job's requests on each server now (what routing reads)
        self.requests = [0] * len(servers)  # requests each server has taken (a metric: how the load was shared)
        self._turn = 0  # who wins a tie
        self._busy_seconds, self._busy_since, self._busy = 0.0, 0.0, 0  # wall time with any request in flight
        self._fan = ThreadPoolExecutor(len(servers), thread_name_prefix="server-sync")

    def _engine(self, server: ServerHandle, index: int, count: int) -> ServerRolloutEngine:
        return ServerRolloutEngine(server, self.tolerance, label=_label(index, count))

    # --- sampling ------------------------------------------------------------------------------
    def _pick(self) -> int:
        with self._lock:
            n = len(self.members)
            order = [(self._turn + i) % n for i in range(n)]
            index = min(order, key=lambda i: self._in_flight[i])
            self._turn = (index + 1) % n
            self._in_flight[index] += 1
            self.requests[index] += 1
            self._busy += 1
            if self._busy == 1:
                self._busy_since = time.perf_counter()
            return index

    def generate(self, prompts: list[list[int]], params: SamplingParams, budgets: list[int] | None = None,
                 images: list[list[Any]] | None = None, generators: list[torch.Generator | None] | None = None) -> list[Completion]:
        """One completion per prompt, on the server with the fewest requests in flight."""
        index = self._pick()
        try:
            return self.members[index].generate(prompts, params, budgets, images, generators)
        finally:
            with self._lock:
                self._in_flight[index] -= 1
                self._busy -= 1
                if not self._busy:
                    self._busy_seconds += time.perf_counter() - self._busy_since

    @property
    def generate_seconds(self) -> float:
        """Seconds with at least one of the job's requests in flight on any server."""
        with self._lock:
            return self._busy_seconds + (time.perf_counter() - self._busy_since if self._busy else 0.0)

    @property
    def generated_tokens(self) -> int:
        return sum(m.generated_tokens for m in self.members)

    def server_metrics(self) -> dict[str, float]:
        """The servers' metrics summed, their number, and the busiest one's share of the requests."""
        out: dict[str, float] = {}
        for m in self.members:
            for key, value in m.server_metrics().items():
                out[key] = out.get(key, 0.0) + value
        with self._lock:
            total = sum(self.requests)
            busiest = max(self.requests) / total if total else 0.0
        return out | {"rollout/servers": float(len(self.members)), "rollout/server_busiest_share": busiest}

    def end_phase(self) -> None:
        """Nothing to free here: each server manages its own cache."""

    # --- weights -------------------------------------------------------------------------------
    @property
    def weights(self) -> str:
        """How a version reaches the servers: "lora" (`sync_adapter`) or "merged" (`sync_weights`)."""
        return self.members[0].server.weights

    @property
    def synced_version(self) -> int | None:
        """The version every server holds, verified (None while they differ, or before any sync)."""
        versions = {m.synced_version for m in self.members}
        return versions.pop() if len(versions) == 1 else None

    @property
    def policy_version(self) -> int:
        """The oldest version a server samples (what a request's tokens may record)."""
        return min(m.policy_version for m in self.members)

    @property
    def served(self) -> str | None:
        """The name requests give the model on every server (None while they differ)."""
        names = {m.served for m in self.members}
        return names.pop() if len(names) == 1 else None

    def _on_each(self, call: Callable[[ServerRolloutEngine], Any]) -> list[Any]:
        """`call` on every server at once; the first failure raised once all have ended."""
        futures = [self._fan.submit(call, m) for m in self.members]
        wait(futures)
        return [f.result() for f in futures]

    def sync_adapter(self, version: int, files: dict[str, bytes] | Callable[[], dict[str, bytes]], probe: Probe) -> float | None:
        """Every server takes the adapter and answers its probe (`ServerRolloutEngine.sync_adapter`):
        the largest gap, or None where every one had the version already. Files are read once."""
        if self.synced_version == version:
            return None
        data = files() if callable(files) else files
        gaps = [g for g in self._on_each(lambda m: m.sync_adapter(version, data, probe)) if g is not None]
        return max(gaps) if gaps else None

    def sync_weights(self, version: int, weights: dict[str, torch.Tensor] | Callable[[], dict[str, torch.Tensor]],
                     probe: Probe) -> Future[float] | None:
        """Every server reloads the weights in place (`ServerRolloutEngine.sync_weights`); one future
        for all their probes: the largest gap, or the first SyncError. Weights are read once."""
        if self.synced_version == version:
            return None
        tensors = weights() if callable(weights) else weights
        verdicts = [v for v in self._on_each(lambda m: m.sync_weights(version, tensors, probe)) if v is not None]
        return _all_of(verdicts)

    def verified(self) -> float | None:
        """Every server's last in-place probe and stamp (`ServerRolloutEngine.verified`): the largest gap."""
        gaps = [g for g in (m.verified() for m in self.members) if g is not None]
        return max(gaps) if gaps else None

    def check_untouched(self) -> None:
        for m in self.members:
            m.check_untouched()

    # --- servers -------------------------------------------------------------------------------
    def dead(self) -> list[int]:
        """The servers whose process or thread has ended (their ServerGone named them)."""
        return [i for i, m in enumerate(self.members) if m.server.ended() is not None]

    def restart(self, start: Callable[[int], ServerHandle]) -> list[int]:
        """New servers in place of the dead ones (all of them where none says it ended: a server
        that answers nothing yet lives), started by `start(index)`; returns which were replaced.
        A new server holds the base: the next sync moves the job's version onto it."""
        replace = self.dead() or list(range(len(self.members)))
        list(self._fan.map(lambda i: self.members[i].close(), replace))
        started = list(self._fan.map(start, replace))
        for i, server in zip(replace, started):
            self.members[i] = self._engine(server, i, len(self.members))
        return replace

    def close(self) -> None:
        """Close every engine at once (each stops a server the job started: vLLM's takes seconds)."""
        list(self._fan.map(ServerRolloutEngine.close, self.members))
        self._fan.shutdown(wait=False)


def _all_of(verdicts: list[Future[float]]) -> Future[float] | None:
    """One future for several probes: the largest gap once all are done, or the first error."""
    if not verdicts:
        return None
    combined: Future[float] = Future()
    left = [len(verdicts)]
    lock = threading.Lock()

    def done(_: Future[float]) -> None:
        with lock:
            left[0] -= 1
            if left[0]:
                return
        errors = [v.exception() for v in verdicts if v.exception() is not None]
        if errors:
            combined.set_exception(errors[0])
        else:
            combined.set_result(max(v.result() for v in verdicts))

    for v in verdicts:
        v.add_done_callback(done)
    return combined
