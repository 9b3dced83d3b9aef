"""Promotion's evaluation on the engine that is faster for it (opentinker/inference/evaluation.py):
vLLM where it runs the model and the evaluation is large enough to repay its start-up, the HF
engine otherwise, each choice one line; both engines give the same greedy answers. The vLLM half
is skipped, with the reason, where vLLM cannot run (tests/vllm_fixtures.py)."""

from __future__ import annotations

import pytest

from tests.conftest import tiny_spec
from tests.vllm_fixtures import lora_checkpoint


def test_auto_evaluates_with_hf_where_vllm_would_not_pay_or_cannot_run(tmp_path):
    from opentinker.backend.vllm_env import vllm_python
    from opentinker.inference.evaluation import VLLM_PAYS_FROM_TOKENS, evaluation_engine

    small = tiny_spec(tmp_path, evaluation={"every": 0, "n_samples": 16})  # 16 problems x 1 turn x 4 tokens
    url = lora_checkpoint(small, "eval-engine")
    assert evaluation_engine(url, small) == ("hf", f"evaluation engine auto chose hf: at most 64 tokens to sample, under the "
                                                   f"{VLLM_PAYS_FROM_TOKENS} from which vLLM's start-up pays")
    large = tiny_spec(tmp_path, evaluation={"every": 0, "n_samples": 512}, rollout={"max_new_tokens": 16})
    engine, line = evaluation_engine(url, large)
    assert engine == "hf" and line.startswith("evaluation engine auto chose hf: ")
    assert ("heads are of size 16" if vllm_python() else "needs vLLM's own environment") in line
    assert evaluation_engine(url, small, "vllm") == ("vllm", "evaluation engine vllm")


def test_vllm_and_hf_evaluate_a_checkpoint_alike(vllm_pool, vllm_tiny_path, tmp_path, monkeypatch):
    """The same checkpoint, validation set and seed through both engines: the same greedy replies
    and rewards (all 16 since the checkpoint is seeded whole; one near-tie is allowed: the tiny
    random model's next-token logits are almost flat, and vLLM's float32 kernels differ from
    transformers' by up to 3e-5); a large enough evaluation of a model vLLM runs chooses vLLM,
    and through vLLM the policy is not loaded in this process too (only its tokenizer)."""
    import opentinker.model as model
    from opentinker.inference.evaluation import evaluate, evaluation_engine

    vllm_pool.room()  # memory for the evaluation's own server
    spec = tiny_spec(tmp_path, model={"name": vllm_tiny_path}, evaluation={"every": 0, "n_samples": 16, "greedy": True},
                     rollout={"max_new_tokens": 6})
    url = lora_checkpoint(spec, "eval-both")
    large = spec.model_copy(update={"evaluation": spec.evaluation.model_copy(update={"n_samples": 2048})})
    assert evaluation_engine(url, large) == ("vllm", "evaluation engine auto chose vllm")
    hf = evaluate(url, spec, "hf")
    loads: list[str] = []
    monkeypatch.setattr(model, "load_policy", lambda *a, **k: loads.append(a[0]) or pytest.fail("the policy loaded beside vLLM"))
    vllm = evaluate(url, spec, "vllm")
    monkeypatch.undo()
    assert loads == []
    assert (hf["engine"], vllm["engine"]) == ("hf", "vllm")
    assert hf["tasks_sha256"] == vllm["tasks_sha256"] and hf["failed"] == vllm["failed"] == 0
    alike = [i for i, (a, b) in enumerate(zip(vllm["replies"], hf["replies"])) if a == b]
    assert len(alike) >= len(hf["replies"]) - 1, (vllm["replies"], hf["replies"])
    assert all(vllm["rewards"][i] == hf["rewards"][i] for i in alike)
    untrained = evaluate(lora_checkpoint(spec, "eval-untrained", scale=0.0), spec, "hf")
    changed = sum(a != b for a, b in zip(untrained["replies"], hf["replies"]))
    assert changed >= len(hf["replies"]) // 2, changed  # the adapter shows in most answers: vLLM served it merged
