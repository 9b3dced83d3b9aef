"""Phase barriers for multi-agent training (the coordinator the reference design describes).

A training step is a sequence of phases (rollout, then update). Within a phase every agent's
work runs concurrently; the phase ends only when all of it has ended (the barrier), so no update
starts before every rollout of its step has finished, and no rollout of step k+1 starts before
every update of step k has finished. An agent that fails or outlives the phase's deadline fails
the phase with a message naming it, instead of leaving the others waiting forever.

Knows no workflow engine: a Prefect flow runs each agent's work of a phase as its own task and
uses the same barrier, and so does a unit test with instrumented agents.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any


class PhaseError(RuntimeError):
    """A phase could not complete: which agents failed or timed out, and why."""


@dataclass
class PhaseEvent:
    phase: str
    step: int
    agent: str
    start: float
    end: float | None = None
    error: str | None = None


@dataclass
class Coordinator:
    """Runs phases of named work (an agent's update, or a joint self-play rollout) with barriers."""

    phase_timeout_s: float = 3600.0
    events: list[PhaseEvent] = field(default_factory=list)

    def run_phase(self, phase: str, step: int, work: dict[str, Callable[[], Any]]) -> dict[str, Any]:
        """Run each agent's callable concurrently and wait for all of them (the barrier)."""
        futures: dict[str, Future] = {}
        for agent, fn in work.items():
            futures[agent] = future = Future()
            event = PhaseEvent(phase, step, agent, time.monotonic())
            self.events.append(event)
            threading.Thread(target=_run, args=(fn, future, event), name=f"{phase}-{agent}", daemon=True).start()
        return collect_phase(phase, step, futures, self.phase_timeout_s)

    def step(self, step: int, rollout: dict[str, Callable[[], Any]], update: Callable[[dict[str, Any]], dict[str, Callable[[], Any]]]) -> dict[str, Any]:
        """One training step: the rollout phase, then the update phase built from its results."""
        batches = self.run_phase("rollout", step, rollout)
        return self.run_phase("update", step, update(batches))


def collect_phase(phase: str, step: int, futures: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    """The barrier: wait for every future of a phase (thread futures here, Prefect task futures
    in a flow) under one deadline; any failure or late one fails the phase, named."""
    deadline = time.monotonic() + timeout_s
    results, problems = {}, []
    for who, future in futures.items():
        try:
            results[who] = future.result(timeout=max(0.0, deadline - time.monotonic()))
        except Exception as err:  # noqa: BLE001 - reported with the agent's name
            late = isinstance(err, TimeoutError) and not getattr(future, "done", lambda: True)()
            problems.append(f"{who} did not finish within {timeout_s:g}s" if late else f"{who} failed: {type(err).__name__}: {err}")
    if problems:
        raise PhaseError(f"{phase} phase of step {step}: " + "; ".join(problems))
    return results


def _run(fn: Callable[[], Any], future: Future, event: PhaseEvent) -> None:
    try:
        future.set_result(fn())
    except BaseException as err:  # noqa: BLE001 - handed to the waiting coordinator
        event.error = f"{type(err).__name__}: {err}"
        future.set_exception(err)
    finally:
        event.end = time.monotonic()
