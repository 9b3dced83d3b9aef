"""A registered checkpoint's evaluation (promotion: challenger against champion) on the engine
that is faster for it on this worker.

vLLM evaluates faster once it runs: the demo's 64 greedy problems took 6.8 s through vLLM in
float32 against 12.1 s on the HF engine (bench/results/vllm_engine.md), but its server starts in
about 20 s on a CPU (the policy merged, then vLLM eager; the evaluation then loads nothing but the
tokenizer here). So `engine: auto` takes vLLM only for an
evaluation that may sample at least VLLM_PAYS_FROM_TOKENS tokens (problems x turns x new tokens: at
the measured rates, about 125 against 225 tokens/s, vLLM saves 20 s from about 5,800 tokens), and
only where vLLM runs the model (`why_not_vllm_here`); the HF engine in this process otherwise.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from opentinker.backend.server_engine import ServerHandle, ServerRolloutEngine
from opentinker.core.spec import JobSpec
from opentinker.eval.promotion import evaluate_checkpoint
from opentinker.inference.launch import launch, why_not_vllm_here
from opentinker.inference.spec import InferenceSpec

log = logging.getLogger(__name__)

VLLM_PAYS_FROM_TOKENS = 8192
ENGINES = ("auto", "hf", "vllm")


def evaluation_engine(checkpoint_url: str, spec: JobSpec, engine: str = "auto") -> tuple[str, str]:
    """(hf | vllm, the choice as one line) for evaluating the checkpoint on `spec`'s validation set here."""
    if engine not in ENGINES:
        raise ValueError(f"engine: {engine!r} is not one of {', '.join(ENGINES)}")
    if engine != "auto":
        return engine, f"evaluation engine {engine}"
    r = spec.rollout
    budget = spec.evaluation.n_samples * r.max_turns * r.max_new_tokens
    if budget < VLLM_PAYS_FROM_TOKENS:
        return "hf", (f"evaluation engine auto chose hf: at most {budget} tokens to sample, under the "
                      f"{VLLM_PAYS_FROM_TOKENS} from which vLLM's start-up pays")
    why = why_not_vllm_here(checkpoint_url)
    return ("hf", f"evaluation engine auto chose hf: {why}") if why else ("vllm", "evaluation engine auto chose vllm")


@contextmanager
def evaluation_rollouts(checkpoint_url: str, spec: JobSpec, engine: str = "auto") -> Iterator[ServerRolloutEngine | None]:
    """The rollout engine to evaluate the checkpoint with: a vLLM server of its own (on loopback,
    with a fresh key, stopped on exit), or None for the HF engine in this process."""
    chosen, line = evaluation_engine(checkpoint_url, spec, engine)
    log.info(line)
    if chosen == "hf":
        yield None
        return
    key = secrets.token_urlsafe(24)
    server = launch(checkpoint_url, InferenceSpec(model_path=checkpoint_url, engine="vllm"), "127.0.0.1", name="policy",
                    api_key=key, max_tokens_cap=max(spec.rollout.max_new_tokens, 64))
    rollouts = ServerRolloutEngine(ServerHandle(url=server.url, model=server.model, api_key=key, stop=server.stop), tolerance=0.0)
    rollouts.synced_version = 0  # the server holds the checkpoint's weights: nothing to move onto it
    try:
        yield rollouts
    finally:
        rollouts.close()  # the server with it


def evaluate(checkpoint_url: str, spec: JobSpec, engine: str = "auto") -> dict[str, Any]:
    """`promotion.evaluate_checkpoint` on the engine `evaluation_engine` chooses; the result names it."""
    with evaluation_rollouts(checkpoint_url, spec, engine) as rollouts:
        result = evaluate_checkpoint(checkpoint_url, spec, rollouts)
    return result | {"engine": "hf" if rollouts is None else "vllm"}
