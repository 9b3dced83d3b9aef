"""tinker-cookbook's own recipes (0.6.1, unmodified) against the gateway, each run to its end the way
a user runs it: `python -m <recipe> flag=value ...` (the recipe module run as `__main__` in this
process, its own `chz` CLI reading the flags), or, where a recipe has no CLI for the feature, its
training `main` with its own dataset builder. On SmolLM2 under its Hub id (the local tokenizer
registered for it, renderer `qwen3_instruct`), with tiny batches and two or three steps each.

Nothing is downloaded: TINKER_BASE_URL and TINKER_API_KEY point the SDK at the test stack's gateway
(each session a Prefect flow on the pool's base-model worker, sessions sharing one base), and where a recipe loads a Hub data
set a few rows are written to a folder of the Hub id's name under the test's folder, its working
directory (`datasets.load_dataset("owner/name")` reads that folder), with HF_HUB_OFFLINE and
HF_DATASETS_OFFLINE set. Each test gets a tenant of its own.

What a test checks: the recipe's completion line in its logs.log, the steps of its metrics.jsonl,
its final checkpoint in checkpoints.jsonl, and what shows that the feature ran (the KL against the
reference, the teacher's KL, the DPO loss, the turns of a multi-turn game). Install the cookbook
and what the recipes import with `make cookbook`. The table in docs/tinker.md ("tinker-cookbook's
recipes") says what each recipe needs."""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import math
import runpy
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"  # an alias the gateway serves for smollm2-135m-instruct
RENDERER = "qwen3_instruct"  # ChatML, SmolLM2's own template; stop token <|im_end|> = 2

pytestmark = pytest.mark.slow


@dataclass
class Gateway:
    url: str
    store: object  # the stack's TenantStore: a tenant per test


@pytest.fixture(scope="module")
def gateway(stack_env):
    """The test stack's gateway (each recipe's sessions are flows on its base-model worker, sharing
    one base), a tenant per test, the SmolLM2 tokenizer registered under the Hub id the recipes name."""
    try:
        import tinker_cookbook  # noqa: F401
        from tinker_cookbook.tokenizer_utils import register_tokenizer, unregister_tokenizer
    except ImportError as e:
        pytest.skip(f"tinker-cookbook 0.6.1 is not importable ({e}); install it with `make cookbook`")
    from transformers import AutoTokenizer

    from opentinker.control.gateway.tenants import TenantStore
    from opentinker.control.submit import deploy
    from opentinker.model.loading import resolve_model

    settings, _ = stack_env
    deploy(settings)
    tokenizer = AutoTokenizer.from_pretrained(resolve_model("smollm2-135m-instruct"))
    register_tokenizer(MODEL, lambda: tokenizer)
    try:
        yield Gateway(settings.gateway_url, TenantStore(settings.state_dir / "tenants.json"))
    finally:
        unregister_tokenizer(MODEL)


_tenants = itertools.count()


@pytest.fixture
def run_dir(gateway, tmp_path, monkeypatch):
    """The test's folder as working directory, the SDK pointed at the gateway with a tenant of the
    test's own, offline; afterwards the root logger as it was (the cookbook replaces its handlers)
    and the tenant's sessions ended."""
    import datasets
    import huggingface_hub

    tenant = f"recipe{next(_tenants)}"
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TINKER_BASE_URL", gateway.url)
    monkeypatch.setenv("TINKER_API_KEY", gateway.store.create(tenant, rotate=True))
    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    # The libraries read these at import, which happened before this test.
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True, raising=False)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", True, raising=False)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-datasets-cache")  # not the user's cache
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    started = time.monotonic()
    try:
        yield tmp_path
    finally:
        print(f"{tenant}: {time.monotonic() - started:.1f} s")
        for handler in [h for h in root.handlers if h not in handlers]:
            handler.close()
        root.handlers[:] = handlers
        root.setLevel(level)
        # the recipes never close their clients: their sessions end as any finished script's do (docs/tinker.md)


def _run_recipe(monkeypatch, module: str, **flags) -> None:
    """`python -m module key=value ...`: the recipe's own `__main__` block in this process."""
    argv = [module, *(f"{k}={v}" for k, v in flags.items())]
    monkeypatch.setattr(sys, "argv", argv)
    runpy.run_module(module, run_name="__main__", alter_sys=False)


def _rows(log_path: Path) -> list[dict]:
    return [json.loads(line) for line in (log_path / "metrics.jsonl").read_text().splitlines() if line.strip()]


def _log(log_path: Path) -> str:
    return (log_path / "logs.log").read_text()


def _checkpoints(log_path: Path) -> list[dict]:
    return [json.loads(line) for line in (log_path / "checkpoints.jsonl").read_text().splitlines() if line.strip()]


def _rl_steps(rows: list[dict]) -> list[dict]:
    """rl.train's training rows (the row after the last step carries only the run's token totals)."""
    return [row for row in rows if "env/all/reward/total" in row and "optim/lr" in row]


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def _final_is_saved(log_path: Path, batch: int) -> None:
    final = _checkpoints(log_path)[-1]
    assert final["name"] == "final" and final["batch"] == batch, final
    assert final["state_path"].startswith("tinker://") and final["sampler_path"].startswith("tinker://")


QUESTIONS = ["What is 2 + 3?", "Name a colour of the sky.", "What is the capital of France?",
             "How many legs does a cat have?", "What is 10 - 4?", "Spell the word cat."]


def test_math_rl_async_ppo(run_dir, monkeypatch):
    """recipes.math_rl.train (arithmetic, no data) with its async config: `max_steps_off_policy=2`,
    `loss_fn=ppo`, three steps, a checkpoint at step 2 and the final one."""
    log_path = run_dir / "run"
    _run_recipe(monkeypatch, "tinker_cookbook.recipes.math_rl.train", model_name=MODEL, renderer_name=RENDERER,
                env="arithmetic", group_size=2, groups_per_batch=2, max_tokens=5, learning_rate=1e-4, lora_rank=8,
                loss_fn="ppo", max_steps_off_policy=2, max_steps=3, eval_every=0, save_every=2,
                log_path=log_path, behavior_if_log_dir_exists="raise")
    assert "Training completed successfully" in _log(log_path)
    steps = _rl_steps(_rows(log_path))
    assert [row["step"] for row in steps] == [0, 1, 2]
    assert all(row["env/all/total_episodes"] == 4 for row in steps)
    assert [c["name"] for c in _checkpoints(log_path)] == ["000000", "000002", "final"]  # the async loop saves its first sampler too
    _final_is_saved(log_path, 3)


def test_rl_kl_reference(run_dir):
    """rl.train.main with `kl_penalty_coef > 0` and a KLReferenceConfig on the base model: the
    reference is a base-model sampler; at step 0 (a fresh LoRA, equal to the base) the KL is ~0."""
    from tinker_cookbook.recipes.math_rl.arithmetic_env import ArithmeticDatasetBuilder
    from tinker_cookbook.rl import train

    log_path = run_dir / "run"
    config = train.Config(
        learning_rate=1e-3,
        dataset_builder=ArithmeticDatasetBuilder(batch_size=2, group_size=2, n_batches=4,
                                                 model_name_for_tokenizer=MODEL, renderer_name=RENDERER),
        model_name=MODEL, renderer_name=RENDERER, recipe_name="opentinker_test_kl", lora_rank=8,
        max_tokens=5, max_steps=2, save_every=0, eval_every=0, num_groups_to_log=0, log_path=str(log_path),
        kl_penalty_coef=0.1, kl_reference_config=train.KLReferenceConfig(base_model=MODEL),
    )
    asyncio.run(train.main(config))
    assert "Training completed successfully" in _log(log_path)
    steps = _rl_steps(_rows(log_path))
    assert [row["step"] for row in steps] == [0, 1]
    kls = [row["kl_policy_base"] for row in steps]
    assert all(math.isfinite(kl) for kl in kls)
    assert abs(kls[0]) < 1e-3, kls  # the policy's sampled logprobs against the base sampler's
    _final_is_saved(log_path, 2)


def test_dpo(run_dir, monkeypatch):
    """recipes.preference.dpo.train on `dataset=hhh` (a stand-in Anthropic/hh-rlhf folder): two
    steps of two pairs; at step 0 the policy is its reference, so the DPO loss is ln 2."""
    def pair(i: int) -> dict:
        q = QUESTIONS[i % len(QUESTIONS)]
        return {"chosen": f"\n\nHuman: {q}\n\nAssistant: Here is a short, correct answer.",
                "rejected": f"\n\nHuman: {q}\n\nAssistant: I will not answer that."}

    _write_jsonl(run_dir / "Anthropic/hh-rlhf/train.jsonl", [pair(i) for i in range(4)])
    _write_jsonl(run_dir / "Anthropic/hh-rlhf/test.jsonl", [pair(i) for i in range(4, 6)])
    log_path = run_dir / "run"
    _run_recipe(monkeypatch, "tinker_cookbook.recipes.preference.dpo.train", model_name=MODEL, renderer_name=RENDERER,
                dataset="hhh", batch_size=2, max_length=256, learning_rate=1e-4, max_steps=2,
                log_path=log_path, behavior_if_log_dir_exists="raise")
    assert "DPO training completed successfully" in _log(log_path)
    rows = [row for row in _rows(log_path) if "dpo_loss" in row]
    assert [row["step"] for row in rows] == [0, 1]
    assert all(row["num_pairs"] == 2 for row in rows)
    assert rows[0]["dpo_loss"] == pytest.approx(math.log(2), abs=1e-3)
    assert any(k.endswith("nll") for k in rows[0]), rows[0]  # its test-set evaluator ran at step 0
    _final_is_saved(log_path, 0)  # train_dpo records the final checkpoint at batch 0 of epoch num_epochs


def test_on_policy_distillation(run_dir, monkeypatch):
    """recipes.distillation.on_policy_distillation on `dataset=deepmath` (a stand-in
    zwhe99/DeepMath-103K folder), the teacher a base-model sampler: the student (a fresh LoRA of
    the same base) starts with a teacher KL of ~0."""
    _write_jsonl(run_dir / "zwhe99/DeepMath-103K/train.jsonl", [{"question": q} for q in QUESTIONS[:4]])
    log_path = run_dir / "run"
    _run_recipe(monkeypatch, "tinker_cookbook.recipes.distillation.on_policy_distillation", model_name=MODEL,
                teacher_model=MODEL, renderer_name=RENDERER, dataset="deepmath", group_size=2, groups_per_batch=2,
                max_tokens=8, lora_rank=8, learning_rate=1e-4, max_steps=2, eval_every=0, save_every=0,
                log_path=log_path, behavior_if_log_dir_exists="raise")
    assert "Training completed successfully" in _log(log_path)
    steps = [row for row in _rows(log_path) if "teacher_kl" in row]
    assert [row["step"] for row in steps] == [0, 1]
    assert abs(steps[0]["teacher_kl"]) < 1e-3, steps[0]["teacher_kl"]
    _final_is_saved(log_path, 2)


def _openthoughts(run_dir: Path) -> None:
    rows = [{"conversations": [{"from": "human", "value": q},
                               {"from": "gpt", "value": f"Let me think. The answer to '{q}' is short."}]}
            for q in QUESTIONS[:4]]
    _write_jsonl(run_dir / "open-thoughts/OpenThoughts3-1.2M/train.jsonl", rows)


def test_off_policy_distillation(run_dir):
    """distillation.train_off_policy.main with recipes.distillation.off_policy_reasoning's own
    OpenThoughts3 builder (a stand-in folder): the teacher's top-20 prompt logprobs become [N, 20]
    soft targets of `cross_entropy`."""
    from tinker_cookbook.distillation import train_off_policy
    from tinker_cookbook.distillation.datasets import TeacherConfig
    from tinker_cookbook.recipes.distillation.off_policy_reasoning import OpenThoughts3Builder
    from tinker_cookbook.supervised.types import ChatDatasetBuilderCommonConfig

    _openthoughts(run_dir)
    log_path = run_dir / "run"
    builder = OpenThoughts3Builder(
        common_config=ChatDatasetBuilderCommonConfig(model_name_for_tokenizer=MODEL, renderer_name=RENDERER,
                                                     max_length=256, batch_size=2),
        buffer_size=4, max_prompts=4)
    config = train_off_policy.Config(
        learning_rate=1e-4, model_name=MODEL, recipe_name="opentinker_test_off_policy", renderer_name=RENDERER,
        lora_rank=8, batch_size=2, max_steps=2, save_every=0, log_path=str(log_path),
        dataset_configs=[train_off_policy.DatasetWithTeacher(dataset_builder=builder,
                                                             teacher_config=TeacherConfig(base_model=MODEL))])
    asyncio.run(train_off_policy.main(config))
    log = _log(log_path)
    assert "Off-policy distillation completed successfully" in log
    assert "Teacher returned no prompt logprobs" not in log  # else it fell back to hard targets
    rows = [row for row in _rows(log_path) if "batch_size" in row]
    assert [row["step"] for row in rows] == [0, 1]
    assert all(row["batch_size"] == 2 and math.isfinite(row["train/loss:sum"]) for row in rows), rows
    _final_is_saved(log_path, 2)


def test_off_policy_reasoning_sft(run_dir, monkeypatch):
    """recipes.distillation.off_policy_reasoning's CLI itself: SFT on OpenThoughts3 (a stand-in
    folder, streamed), two steps."""
    _openthoughts(run_dir)
    log_path = run_dir / "run"
    _run_recipe(monkeypatch, "tinker_cookbook.recipes.distillation.off_policy_reasoning", model_name=MODEL,
                renderer_name=RENDERER, batch_size=2, max_length=256, lora_rank=8, learning_rate=1e-4,
                buffer_size=4, max_prompts=4, max_steps=2, eval_every=0, save_every=0,
                log_path=log_path, behavior_if_log_dir_exists="raise")
    assert "Training completed successfully" in _log(log_path)
    rows = [row for row in _rows(log_path) if "train_mean_nll" in row]
    assert [row["step"] for row in rows] == [0, 1]
    _final_is_saved(log_path, 0)  # supervised.train records the final checkpoint at batch 0 of epoch num_epochs


def test_preference_shorter(run_dir, monkeypatch):
    """recipes.preference.shorter.train (no data: one prompt, a preference for the shorter answer
    between a group's samples), with its `compute_post_kl` (the sampler's KL before/after a step)."""
    log_path = run_dir / "run"
    _run_recipe(monkeypatch, "tinker_cookbook.recipes.preference.shorter.train", model_name=MODEL,
                renderer_name=RENDERER, batch_size=1, group_size=2, max_tokens=8, learning_rate=1e-4, max_steps=2,
                eval_every=0, log_path=log_path, behavior_if_log_dir_exists="raise")
    assert "Training completed successfully" in _log(log_path)
    steps = _rl_steps(_rows(log_path))
    assert [row["step"] for row in steps] == [0, 1]
    assert all(math.isfinite(row["kl_pre_post_v1"]) for row in steps), steps
    _final_is_saved(log_path, 2)


def test_guess_number(run_dir, monkeypatch):
    """recipes.multiplayer_rl.guess_number.train: a multi-turn game, an episode ending at the right
    guess or after 10 turns."""
    log_path = run_dir / "run"
    _run_recipe(monkeypatch, "tinker_cookbook.recipes.multiplayer_rl.guess_number.train", model_name=MODEL,
                renderer_name=RENDERER, group_size=2, batch_size=1, max_tokens=8, learning_rate=1e-4,
                max_steps=2, eval_every=0, save_every=0, log_path=log_path, behavior_if_log_dir_exists="raise")
    assert "Training completed successfully" in _log(log_path)
    steps = _rl_steps(_rows(log_path))
    assert [row["step"] for row in steps] == [0, 1]
    for row in steps:
        assert row["env/all/total_episodes"] == 2
        # Every episode plays 10 turns unless one guessed right (reward 1).
        assert row["env/all/turns_per_episode"] == 10 or row["env/all/reward/total"] > 0, row
        assert row["env/all/total_turns"] > row["env/all/total_episodes"]
    _final_is_saved(log_path, 2)


def test_text_arena(run_dir, monkeypatch):
    """recipes.multiplayer_rl.text_arena.train: tic-tac-toe in self-play (textarena's TicTacToe-v0,
    no data), the test opponent the base model; two steps of one game (two players)."""
    pytest.importorskip("textarena", reason="textarena==0.7.4 (make cookbook installs it)")
    log_path = run_dir / "run"
    _run_recipe(monkeypatch, "tinker_cookbook.recipes.multiplayer_rl.text_arena.train", model_name=MODEL,
                renderer_name=RENDERER, batch_size=2, num_train_datapoints=4, num_test_datapoints=2, max_tokens=8,
                learning_rate=1e-4, max_steps=2, eval_every=0, save_every=0, log_path=log_path,
                behavior_if_log_dir_exists="raise")
    assert "Training completed successfully" in _log(log_path)
    steps = _rl_steps(_rows(log_path))
    assert [row["step"] for row in steps] == [0, 1]
    assert all(row["env/all/total_episodes"] == 2 for row in steps)
    _final_is_saved(log_path, 2)
