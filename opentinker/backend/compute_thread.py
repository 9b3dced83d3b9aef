"""One thread for a shared worker's arithmetic on the CPU: sampling batches and training passes.

Why: torch's CPU kernels run on OpenMP (libgomp), which keeps a team of threads for every thread
that has run a parallel region. Once the teams of a process hold more threads than it has CPUs,
libgomp throttles its idle threads' spinning (100 spins, then sleep), so each parallel region
waits for its threads to wake. A base-model worker sampled in its engine's thread and trained in
its callers' threads: two teams on the 2-core machine, and a hosted job's update took 4.4 s
instead of 3.1 s (its own process: 3.1 s; that process with one idle second team: 4.5 s). Its
heavy calls run here instead, one thread, one team: the engine's decode batches, the hosted native
jobs' passes and the base's load. Tinker passes keep their runner thread: several sessions gain
more from sampling beside each other's passes than the throttling costs (bench/shared_base.py at
N = 4: 1.39x the tokens/s of a server each with the passes beside, 0.84x with them here, 1.22x
before this thread), where native jobs gain from one thread (bench/shared_jobs.py at N = 4: 0.86x,
was 0.73x). On a GPU the device does the arithmetic, and
sampling beside training overlaps there: calls run where they are made.
"""

from __future__ import annotations

import contextvars
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

import torch

T = TypeVar("T")

_calls: queue.Queue[tuple[contextvars.Context, Callable[..., Any], tuple, dict, Future]] = queue.Queue()
_thread: threading.Thread | None = None
_start_lock = threading.Lock()


def run(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """`fn(*args, **kwargs)` on the compute thread, in a copy of the caller's context (its
    ContextVars: which adapter a forward uses); its result, or its exception raised here. A call
    from the compute thread itself runs at once (no deadlock on nesting)."""
    global _thread
    if threading.current_thread() is _thread:
        return fn(*args, **kwargs)
    with _start_lock:
        if _thread is None:
            _thread = threading.Thread(target=_serve, name="opentinker-compute", daemon=True)
            _thread.start()
    future: Future = Future()
    _calls.put((contextvars.copy_context(), fn, args, kwargs, future))
    return future.result()


def run_on(device: torch.device, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """`run` for work on the CPU; on another device, `fn` runs in the caller's thread."""
    if device.type == "cpu":
        return run(fn, *args, **kwargs)
    return fn(*args, **kwargs)


def _serve() -> None:
    while True:
        context, fn, args, kwargs, future = _calls.get()
        if not future.set_running_or_notify_cancel():
            continue
        try:
            future.set_result(context.run(fn, *args, **kwargs))
        except BaseException as err:  # noqa: BLE001 - the caller gets it; this thread serves the next call
            future.set_exception(err)
