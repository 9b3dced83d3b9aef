"""tinker-cookbook's own RL loop (`tinker_cookbook.rl.train.main`, 0.6.1, unmodified) against the
gateway, with the sessions in this process: its data-free arithmetic environment on SmolLM2,
periodic and final checkpoints, and a second run on the same log folder that resumes from the
checkpoint the cookbook recorded in checkpoints.jsonl.

Offline: the tokenizer is the local SmolLM2 folder, registered under the Hub id the run names
(the server receives that id as `base_model`); the cookbook's pricing fetch fails fast and is
non-fatal. Install the cookbook with `make cookbook` (see the Makefile for why --no-deps)."""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path

import pytest

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"  # an alias the gateway serves for smollm2-135m-instruct
RENDERER = "qwen3_instruct"  # ChatML, SmolLM2's own template; stop token <|im_end|> = 2


def _cookbook():
    """(rl.train, ArithmeticDatasetBuilder, register_tokenizer), or skip naming what is missing."""
    try:
        from tinker_cookbook.recipes.math_rl.arithmetic_env import (
            ArithmeticDatasetBuilder,
        )
        from tinker_cookbook.rl import train
        from tinker_cookbook.tokenizer_utils import register_tokenizer
    except ImportError as e:
        pytest.skip(f"tinker-cookbook 0.6.1 is not importable ({e}); install it with `make cookbook`")
    return train, ArithmeticDatasetBuilder, register_tokenizer


def _config(train, builder, url: str, log_path: Path, max_steps: int):
    return train.Config(
        learning_rate=1e-4,
        dataset_builder=builder(batch_size=4, group_size=4, n_batches=20,
                                model_name_for_tokenizer=MODEL, renderer_name=RENDERER),
        model_name=MODEL,
        renderer_name=RENDERER,
        recipe_name="opentinker_test_arithmetic",
        loss_fn="importance_sampling",
        lora_rank=8,
        max_tokens=6,
        max_steps=max_steps,
        save_every=2,
        eval_every=0,
        num_groups_to_log=0,
        log_path=str(log_path),
        base_url=url,
    )


def _checkpoints(log_path: Path) -> list[dict]:
    return [json.loads(line) for line in (log_path / "checkpoints.jsonl").read_text().splitlines() if line.strip()]


def _metric_steps(log_path: Path) -> list[int]:
    """The steps of the training rows in the run's metrics.jsonl, in file order (the row after the
    last step carries only the run's token totals)."""
    rows = [json.loads(line) for line in (log_path / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [row["step"] for row in rows if "env/all/reward/total" in row and "optim/lr" in row]


def _run(train, config) -> str:
    """Run the cookbook's main to its end; its log (logs.log in the run folder) as text."""
    asyncio.run(train.main(config))
    return (Path(config.log_path) / "logs.log").read_text()


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_cookbook_rl_loop_trains_checkpoints_and_resumes(tmp_path, monkeypatch):
    """rl.train.main runs 3 steps (checkpoints at step 2 and final) and then, on the same log
    folder with max_steps=5, resumes from the last recorded state and runs steps 3 and 4 only."""
    train, builder, register_tokenizer = _cookbook()
    import tinker
    from transformers import AutoTokenizer

    from opentinker.control.gateway.tinker_local import local_gateway
    from opentinker.model.loading import resolve_model

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    root = logging.getLogger()
    root_handlers, root_level = root.handlers[:], root.level  # the cookbook replaces the root handlers
    tokenizer = AutoTokenizer.from_pretrained(resolve_model("smollm2-135m-instruct"))
    register_tokenizer(MODEL, lambda: tokenizer)
    url, keys, sessions, server = local_gateway(tmp_path / "gateway")
    monkeypatch.setenv("TINKER_API_KEY", keys["alice"])  # rl.train.main passes no api_key
    log_path = tmp_path / "run"
    try:
        log = _run(train, _config(train, builder, url, log_path, max_steps=3))
        assert "Training completed successfully" in log
        first = _checkpoints(log_path)
        assert [c["name"] for c in first] == ["000002", "final"]
        assert [c["batch"] for c in first] == [2, 3]
        assert _metric_steps(log_path) == [0, 1, 2]

        rest = tinker.RestClient(base_url=url)
        state = first[-1]["state_path"]
        run_id = state.removeprefix("tinker://").split("/")[0]
        listed = {c.tinker_path for c in rest.list_checkpoints(run_id).result().checkpoints}
        assert {first[0]["state_path"], state, first[-1]["sampler_path"]} <= listed

        log = _run(train, _config(train, builder, url, log_path, max_steps=5))[len(log):]  # logs.log is appended to
        assert f"Resumed training from {state}" in log
        assert "Training completed successfully" in log
        second = _checkpoints(log_path)[len(first):]
        assert [(c["name"], c["batch"]) for c in second] == [("000004", 4), ("final", 5)]
        assert _metric_steps(log_path) == [0, 1, 2, 3, 4]  # steps 0-2 were not run again
        new_run = second[-1]["state_path"].removeprefix("tinker://").split("/")[0]
        assert new_run != run_id  # the resumed run trains a new model created from the checkpoint
        assert second[-1]["state_path"] in {c.tinker_path for c in rest.list_checkpoints(new_run).result().checkpoints}
    finally:
        from tinker_cookbook.tokenizer_utils import unregister_tokenizer

        unregister_tokenizer(MODEL)
        for handler in [h for h in root.handlers if h not in root_handlers]:
            handler.close()
        root.handlers[:] = root_handlers
        root.setLevel(root_level)
        server.stop()
        sessions.close()
