"""Learning, measured: the tiny model learns a toy task within a minute (CI); the real model
learns arithmetic and the small VLM learns through the picture (slow, `pytest -m slow`; the full
curves are bench/learning_math.py and bench/learning_vlm.py)."""

import statistics

import pytest

from opentinker.rl import RLJob
from tests.conftest import tiny_spec


def test_tiny_model_learns_the_uppercase_task(tmp_path, tiny_path):
    spec = tiny_spec(
        tmp_path,
        adapter={"kind": "full"},
        rollout={"prompts_per_step": 8, "group_size": 4, "max_new_tokens": 4, "temperature": 0.1},
        optimization={"steps": 16, "lr": 1e-3},
        checkpoint={"every": 0},
        seed=1,  # greedy accuracy goes 0 -> 1 for every seed tried; with this one the sampled reward at 0.1 moves too (0.32 -> 0.88)
    )
    result = RLJob(spec, job_id="learn").run()
    rewards = [h["rollout/reward_mean"] for h in result.history]
    first_eval, last_eval = result.evaluations[0].metrics, result.evaluations[-1].metrics
    # Greedy accuracy is what moves: the random model's logits are nearly flat over 49k tokens, so
    # its argmax turns right long before sampling (the full softmax, even at 0.1) concentrates on it.
    assert last_eval["eval/accuracy"] >= first_eval["eval/accuracy"] + 0.5, (first_eval, last_eval, rewards)
    assert statistics.fmean(rewards[-4:]) >= statistics.fmean(rewards[:4]), rewards


@pytest.mark.slow
def test_smollm2_learns_addition(tmp_path):
    from opentinker.core.spec import load_spec

    spec = load_spec("examples/math_grpo.yaml")
    spec = spec.model_copy(update={"checkpoint": spec.checkpoint.model_copy(update={"base_url": f"file://{tmp_path}"})})
    result = RLJob(spec, job_id="smollm2-add").run()
    first, last = result.evaluations[0].metrics, result.evaluations[-1].metrics
    assert last["eval/accuracy"] >= first["eval/accuracy"] + 0.1
    assert last["eval/distinct_answer_share"] >= 0.5 * first["eval/distinct_answer_share"]  # no collapse onto one answer


@pytest.mark.slow
def test_smolvlm_learns_through_the_picture_and_not_from_blank_ones(tmp_path):
    """examples/vlm_shapes.yaml for 10 steps, with the pictures and with blank ones (~9 minutes)."""
    from opentinker.core.spec import load_spec

    spec = load_spec("examples/vlm_shapes.yaml")
    spec = spec.model_copy(update={"optimization": spec.optimization.model_copy(update={"steps": 10}),
                                   "checkpoint": spec.checkpoint.model_copy(update={"every": 0, "base_url": f"file://{tmp_path}"})})
    last = {}
    for blank in (False, True):
        env = spec.env.model_copy(update={"config": {**spec.env.config, "blank": blank}})
        result = RLJob(spec.model_copy(update={"env": env}), job_id=f"vlm-{blank}").run()
        last[blank] = result.evaluations[-1].metrics
    assert last[False]["eval/accuracy"] >= 0.6 and last[False]["eval/distinct_answer_share"] >= 3 / 64, last[False]
    assert last[True]["eval/accuracy"] <= 0.4, last[True]
