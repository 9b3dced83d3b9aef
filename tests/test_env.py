"""Environment API, data sources and the math environment."""

import json

import numpy as np
import pytest

from envs.math import MathGame, parse_answer
from envs.toy import UppercaseGame
from opentinker.env import AbstractGame, GameEnvironment, StepResult
from opentinker.environment.base_game import AbstractGame as RefAbstractGame
from opentinker.environment.base_game import StepResult as RefStepResult
from opentinker.core.spec import parse_spec


def test_reference_import_paths_are_the_same_classes():
    assert RefAbstractGame is AbstractGame and RefStepResult is StepResult


def test_reference_style_game_runs_as_written():
    class CustomGame(AbstractGame):
        def get_system_prompt(self) -> str:
            return "You are an agent playing a custom game..."

        def get_initial_user_message(self) -> str:
            return "Game starts. Your turn."

        def reset(self, **kwargs) -> str:
            self.state = "start"
            return "Initial observation"

        def step(self, action: str) -> StepResult:
            if action != "go":
                return StepResult(observation="Invalid", reward=-1.0, done=False)
            return StepResult(observation="won", reward=1.0, done=True)

    env = GameEnvironment(game_class=CustomGame, config={"dataset": [{}] * 10, "val_fraction": 0.2}, job_id="j1")
    game = env.make_game()
    assert game.reset(**env.train_tasks(1)[0]) == "Initial observation"
    assert game.step("x") == StepResult("Invalid", -1.0, False)


def test_generated_tasks_are_seeded_and_never_repeat_validation():
    cfg = {"low": 1, "high": 5, "val_size": 10, "seed": 4}
    a = GameEnvironment(MathGame, cfg)
    b = GameEnvironment(MathGame, cfg)
    assert a.validation_tasks() == b.validation_tasks() and len(a.validation_tasks()) == 10
    train = a.train_tasks(200)
    assert train == b.train_tasks(200)
    val = {t["question"] for t in a.validation_tasks()}
    assert not val & {t["question"] for t in train}
    assert GameEnvironment(MathGame, {**cfg, "seed": 5}).validation_tasks() != a.validation_tasks()


def test_state_round_trip_continues_the_stream():
    env = GameEnvironment(MathGame, {"seed": 1})
    env.train_tasks(7)
    state = json.loads(json.dumps(env.state()))  # checkpoints store it as JSON
    expected = env.train_tasks(5)
    other = GameEnvironment(MathGame, {"seed": 1})
    other.load_state(state)
    assert other.train_tasks(5) == expected


def test_static_jsonl_dataset_with_a_validation_split(tmp_path):
    rows = [{"question": f"What is {i} + 1?", "answer": i + 1} for i in range(20)]
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    env = GameEnvironment(MathGame, {"data_path": str(path), "val_fraction": 0.25, "seed": 0})
    val = env.validation_tasks()
    assert len(val) == 5
    first_epoch = env.train_tasks(15)
    assert sorted(r["answer"] for r in first_epoch + val) == list(range(1, 21))  # a partition
    assert len(env.train_tasks(15)) == 15  # the next epoch, reshuffled


def test_environment_from_a_job_spec():
    spec = parse_spec({"model": {"name": "tiny-random"}, "env": {"game": "envs.math:MathGame", "config": {"val_size": 8, "operations": ["*"]}}, "seed": 2})
    env = GameEnvironment(game_class=MathGame, config=spec, job_id="j")
    assert len(env.validation_tasks()) == 8 and all("*" in t["question"] for t in env.train_tasks(4))


@pytest.mark.parametrize(
    "text,expected",
    [("Answer: 12", 12), ("so 3 + 4 = 7. Answer: 7", 7), ("Answer:-3", -3), ("Answer: 5 ... Answer: 6", 6), ("The answer is 12", None), ("answer: 12", None)],
)
def test_strict_answer_format(text, expected):
    assert parse_answer(text) == expected


def test_math_rewards_and_format_bonus():
    game = MathGame()
    game.reset(question="What is 2 + 2?", answer=4)
    assert game.step("Answer: 4").reward == 1.0
    assert game.step("Answer: 5").reward == 0.0
    assert game.step("4").info == {"correct": False, "format_ok": False, "answer": None, "expected": 4}
    bonus = MathGame(format_reward=0.1)
    bonus.reset(question="What is 2 + 2?", answer=4)
    assert bonus.step("Answer: 5").reward == pytest.approx(0.1)
    assert bonus.step("Answer: 4").reward == pytest.approx(1.1)


def test_math_generation_operations_and_few_shot():
    rng = np.random.default_rng(0)
    for _ in range(50):
        task = MathGame.generate_task(rng, low=1, high=9, operations=["+", "-", "*", "/"])
        a, op, b = task["question"].removeprefix("What is ").removesuffix("?").split()
        assert task["answer"] == int(eval(f"{a} {op.replace('/', '//')} {b}"))  # test-side check only
        if op == "/":
            assert int(a) % int(b) == 0
    assert len(MathGame(few_shot=2).get_example_turns()) == 4
    assert MathGame(few_shot=0).get_example_turns() == []
    with pytest.raises(ValueError):
        MathGame.generate_task(rng, operations=["^"])


# --- the reference environment API in full: data-free games, generate_initial_state, job args ---


class GuessGame(AbstractGame):
    """Data-free, as in the reference design: reset draws its own start (no dataset, no generator)."""

    def get_system_prompt(self) -> str:
        return "Guess the number."

    def reset(self, **kwargs) -> str:
        import random

        self.target = random.randint(1, 1000)
        return f"I think of a number ({self.target % 7} mod 7)."

    def step(self, action: str) -> StepResult:
        return StepResult(observation="", reward=float(action.strip() == str(self.target)), done=True)


class StartStateGame(GuessGame):
    """Its start comes from generate_initial_state(), drawn with the seeded generators."""

    def generate_initial_state(self) -> dict:
        import numpy as np

        return {"target": int(np.random.randint(1, 1000))}

    def reset(self, target: int = 0, **_) -> str:
        self.target = target
        return f"target {target}"


def test_a_data_free_game_trains_from_seed_tasks_and_validates_reproducibly():
    from opentinker.env.hosting import start_episode

    env = GameEnvironment(GuessGame, {"val_size": 8})
    val = env.validation_tasks()
    assert len({t["__seed__"] for t in val}) == 8 and all(set(t) == {"__seed__"} for t in val)
    train = env.train_tasks(50)
    assert not {t["__seed__"] for t in train} & {t["__seed__"] for t in val}  # never a validation episode
    first = [start_episode(env.make_game(), t) for t in val]
    again = [start_episode(GameEnvironment(GuessGame, {"val_size": 8}).make_game(), t) for t in val]
    assert first == again and len(set(first)) > 1  # the same validation episodes every time
    assert env.epoch_size == 8


def test_generate_initial_state_is_honoured():
    from opentinker.env.hosting import start_episode

    env = GameEnvironment(StartStateGame, {"val_size": 4})
    starts = [start_episode(env.make_game(), t) for t in env.validation_tasks()]
    assert starts == [start_episode(StartStateGame(), t) for t in env.validation_tasks()]
    assert all(s.startswith("target ") and s != "target 0" for s in starts)


def test_config_may_be_the_jobs_own_args():
    import argparse

    from opentinker.core.spec import parse_spec

    args = {"model": {"name": "tiny-random"}, "rollout": {"group_size": 2}, "seed": 5,
            "env": {"game": "envs.toy:UppercaseGame", "config": {"val_size": 3}}}
    for config in (args, argparse.Namespace(**args), parse_spec(args)):
        env = GameEnvironment(UppercaseGame, config=config, job_id="j")
        assert len(env.validation_tasks()) == 3 and env.seed == 5 and env.generator_config == {}
    bare = GameEnvironment(GuessGame, config={"model": {"name": "tiny-random"}, "seed": 1})  # job args, no env part
    assert bare.generator_config == {} and len(bare.validation_tasks()) == 64
