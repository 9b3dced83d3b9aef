"""Bad specs fail before any work, naming the field and the reason."""

import pytest

from opentinker.core.spec import SpecError, dump_spec, load_spec, parse_spec

BASE = {"model": {"name": "tiny-random"}, "env": {"game": "envs.math:MathGame"}}


def _error(data) -> str:
    with pytest.raises(SpecError) as info:
        parse_spec(data)
    return str(info.value)


def test_minimal_spec_fills_defaults():
    spec = parse_spec(BASE)
    assert spec.adapter.kind == "lora" and spec.adapter.r == 16
    assert spec.algorithm.advantage == "grpo" and spec.rollout.group_size == 4


def test_unknown_key_is_named_with_its_path():
    msg = _error({**BASE, "rollout": {"group_sise": 4}})
    assert "rollout.group_sise: unknown key" in msg
    assert "lr_typo: unknown key" in _error({**BASE, "lr_typo": 1})


def test_unknown_key_inside_the_adapter_union():
    msg = _error({**BASE, "adapter": {"kind": "lora", "rank": 8}})
    assert "adapter.rank: unknown key" in msg


def test_negative_lr():
    msg = _error({**BASE, "optimization": {"lr": -1e-4}})
    assert msg.startswith("optimization.lr:") and "greater than 0" in msg


def test_group_size_one_with_grpo():
    msg = _error({**BASE, "rollout": {"group_size": 1}})
    assert "rollout.group_size" in msg and "at least 2" in msg and "grpo" in msg


def test_a_vision_learning_rate_needs_a_vision_side_that_trains():
    msg = _error({**BASE, "adapter": {"kind": "lora", "vision_lr": 1e-3}})
    assert msg.startswith("adapter") and "vision_lr is set but vision_tower is frozen" in msg
    assert parse_spec({**BASE, "adapter": {"kind": "lora", "vision_tower": "connector", "vision_lr": 1e-3}}).adapter.vision_lr == 1e-3


def test_missing_model():
    assert "model: Field required" in _error({"env": {"game": "envs.math:MathGame"}})


def test_unresolvable_model():
    msg = _error({**BASE, "model": {"name": "no-such-model"}})
    assert msg.startswith("model.name:") and "unknown model 'no-such-model'" in msg


def test_bad_enum_and_game_path():
    assert "algorithm.advantage" in _error({**BASE, "algorithm": {"advantage": "ppo"}})
    assert "env.game" in _error({**BASE, "env": {"game": "envs.math.MathGame"}})


def test_yaml_round_trip(tmp_path):
    path = tmp_path / "spec.yaml"
    path.write_text(dump_spec(parse_spec({**BASE, "seed": 7})))
    assert load_spec(path).seed == 7


def test_example_specs_are_valid():
    """Every example parses as the kind of job it describes (SFT specs have `data`, not `env`)."""
    from pathlib import Path

    import yaml

    from opentinker.sft.spec import is_sft_spec, load_sft_spec

    paths = sorted(Path(__file__).parents[1].glob("examples/*.yaml"))
    assert paths
    for path in paths:
        if is_sft_spec(yaml.safe_load(path.read_text())):
            load_sft_spec(path)
        else:
            load_spec(path)


@pytest.mark.parametrize("extra", [{"resources": {"trainer_ranks": 2, "num_gpus": 2}},
                                   {"resources": {"trainer_ranks": 2, "share_base": True}},
                                   {"resources": {"trainer_ranks": 2}, "model": {"name": "tiny-vlm-random"}},
                                   {"resources": {"trainer_ranks": 2}, "multiagent": {"players": ["X", "O"]}}],
                         ids=["gpus", "shared-base", "vlm", "self-play"])
def test_a_sharded_trainer_is_refused_where_it_does_not_run_yet(extra):
    msg = _error({**BASE, **extra})
    assert "resources.trainer_ranks: a sharded trainer trains one text model's policy in CPU processes" in msg, msg


def test_a_sharded_sft_job_is_refused():
    from opentinker.sft.spec import SFTSpec
    from opentinker.core.spec_limits import validate_spec

    with pytest.raises(SpecError, match="resources.trainer_ranks: SFT jobs train in one process"):
        validate_spec(SFTSpec, {"model": {"name": "tiny-random"}, "data": {"path": "x.jsonl"}, "resources": {"trainer_ranks": 2}})
    assert parse_spec({**BASE, "resources": {"trainer_ranks": 4}}).resources.trainer_ranks == 4
    assert parse_spec({**BASE, "resources": {"trainer_ranks": 4, "trainer_placement": "spread"}}).resources.trainer_placement == "spread"
    assert "resources.trainer_placement" in _error({**BASE, "resources": {"trainer_ranks": 2, "trainer_placement": "scatter"}})


def test_per_turn_credit_is_the_algorithms_for_every_job():
    spec = parse_spec({**BASE, "algorithm": {"advantage": "grpo_per_step", "gamma": 0.9}})
    assert (spec.algorithm.advantage, spec.algorithm.gamma) == ("grpo_per_step", 0.9)
    assert "algorithm.gamma" in _error({**BASE, "algorithm": {"advantage": "grpo_per_step", "gamma": 1.5}})
    assert "multiagent.credit" in _error({**BASE, "multiagent": {"credit": "turn"}})  # the self-play-only switch is gone
    assert parse_spec({**BASE, "algorithm": {"advantage": "gigpo", "step_weight": 0.5}}).algorithm.step_weight == 0.5
    assert "algorithm.step_weight" in _error({**BASE, "algorithm": {"advantage": "gigpo", "step_weight": -1}})
