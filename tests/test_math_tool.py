"""The calculator tool refuses everything but bounded arithmetic, the game's turns follow the
documented tool format, and episodes run through the real agent loop with exact token masks."""

import numpy as np
import pytest
import torch

from envs.math_tool import CalcError, MathToolGame, calculate, format_number, safe_eval
from opentinker.agent import ChatFormat, EpisodeLimits, run_episodes
from opentinker.backend import HFRolloutEngine, SamplingParams
from opentinker.backend.rollout import Completion
from opentinker.env import GameEnvironment
from opentinker.env.environment import import_game
from opentinker.core.spec import load_spec

TASK = {"question": "What is 17 * 23 + 5?", "answer": 396}


# -- calculator ------------------------------------------------------------------------------
@pytest.mark.parametrize("expr, shown", [
    ("17*23", "391"), ("17 * 23 + 5", "396"), ("(2 + 3) * 4", "20"), ("-7 + +2", "-5"), ("2 ** 10", "1024"),
    ("7 // 2", "3"), ("-7 % 3", "2"), ("6 / 2", "3"), ("1 / 3", "0.333333"), ("2 / 3", "0.666667"),
    ("0.1 + 0.2", "0.3"), ("2 ** -2", "0.25"), ("1.5 * 4", "6"), (" 12 ", "12"), ("1 / 4000000", "2.5e-07"),
])
def test_calculator_values(expr, shown):
    assert calculate(expr) == (True, shown)


def test_calculator_keeps_ints_exact():
    assert safe_eval("99 * 99 * 99") == 970299 and isinstance(safe_eval("99 * 99"), int)
    assert isinstance(safe_eval("6 / 2"), float) and format_number(3.0) == "3" and format_number(-0.0) == "0"


@pytest.mark.parametrize("expr, message", [
    ("__import__('os').system('echo hi')", "only numbers"),
    ("(1).__class__", "only numbers"),
    ("x + 1", "only numbers"),
    ("(lambda: 1)()", "only numbers"),
    ("[1, 2]", "only numbers"),
    ("'a' * 3", "only numbers"),
    ("True + 1", "only numbers"),
    ("1j * 2", "only numbers"),
    ("1 < 2", "only numbers"),
    ("9**9**9", "exponent too large"),
    ("2 ** 11", "exponent too large"),
    ("10**10 * 10**10", "number too large"),
    ("1e999", "number too large"),
    ("9" * 20, "number too large"),
    ("1 / 0", "division by zero"),
    ("5 // 0", "division by zero"),
    ("5 % 0.0", "division by zero"),
    ("0 ** -1", "division by zero"),
    ("(-8) ** 0.5", "not a real number"),
    ("2 +", "syntax error"),
    ("1; 2", "syntax error"),
    ("", "empty expression"),
    ("   ", "empty expression"),
    ("1+" * 100 + "1", "too long"),
])
def test_calculator_refuses_with_a_message(expr, message):
    ok, text = calculate(expr)
    assert not ok and message in text
    with pytest.raises(CalcError):
        safe_eval(expr)


def test_calculator_never_runs_code(tmp_path):
    marker = tmp_path / "ran"
    ok, _ = calculate(f"open({str(marker)!r}, 'w')")
    assert not ok and not marker.exists()
    assert calculate(None) == (False, "expression must be text")  # type: ignore[arg-type]
    assert calculate("-" * 150 + "1") == (True, "1")  # deep but short nesting is fine


# -- game steps ------------------------------------------------------------------------------
def _game(**kwargs):
    game = MathToolGame(**kwargs)
    assert game.reset(**TASK) == TASK["question"]
    return game


def _info(correct=False, answer=None, calls=0, errors=0, format_ok=False):
    return {"correct": correct, "answer": answer, "expected": 396, "tool_calls": calls, "tool_errors": errors, "format_ok": format_ok}


def test_answer_ends_the_episode():
    right = _game().step("Answer: 396")
    assert (right.done, right.reward, right.info) == (True, 1.0, _info(True, 396, format_ok=True))
    wrong = _game().step("I think Answer: 400")
    assert (wrong.done, wrong.reward, wrong.info) == (True, 0.0, _info(False, 400, format_ok=True))
    both = _game().step("<calc>17*23+5</calc> Answer: 396")  # an answer wins over a call in the same turn
    assert both.done and both.reward == 1.0 and both.info["tool_calls"] == 0


def test_calls_then_answer_over_several_turns():
    game = _game()
    first = game.step("<calc>17 * 23</calc>")
    assert (first.observation, first.done, first.reward, first.info) == ("<result>391</result>", False, 0.0, _info(calls=1))
    second = game.step("Now add five: <calc>391 + 5</calc> and more text")
    assert second.observation == "<result>396</result>" and not second.done and second.info["tool_calls"] == 2
    last = game.step("Answer: 396")
    assert (last.done, last.reward, last.info) == (True, 1.0, _info(True, 396, calls=2, format_ok=True))


@pytest.mark.parametrize("action, message", [
    ("<calc>17 * 23", "unclosed <calc> tag"),
    ("<calc></calc>", "empty expression"),
    ("<calc>17 / 0</calc>", "division by zero"),
    ("<calc>__import__('os')</calc>", "only numbers"),
])
def test_malformed_calls_get_an_error_observation(action, message):
    game = _game()
    result = game.step(action)
    assert not result.done and result.reward == 0.0
    assert result.observation.startswith("<error>") and message in result.observation and result.observation.endswith("</error>")
    assert result.info == _info(calls=1, errors=1)
    assert game.step("Answer: 396").info == _info(True, 396, calls=1, errors=1, format_ok=True)  # the episode goes on


def test_call_limit():
    game = _game(max_tool_calls=2)
    assert [game.step("<calc>1 + 1</calc>").observation for _ in range(2)] == ["<result>2</result>"] * 2
    over = game.step("<calc>1 + 1</calc>")
    assert over.observation == "<error>tool call limit reached; give your answer</error>" and not over.done
    assert over.info == _info(calls=3, errors=1)
    assert _game(max_tool_calls=0).step("<calc>1</calc>").observation.startswith("<error>tool call limit")


def test_neither_call_nor_answer_ends_with_zero():
    result = _game().step("The answer is 396.")
    assert (result.done, result.reward, result.info) == (True, 0.0, _info())
    assert result.info["format_ok"] is False


def test_tool_bonus_is_paid_only_after_a_successful_call():
    game = _game(tool_bonus=0.1)
    game.step("<calc>17 * 23 + 5</calc>")
    assert game.step("Answer: 1").reward == pytest.approx(0.1)  # the bonus does not need a right answer: a hacking risk
    assert _game(tool_bonus=0.1).step("Answer: 396").reward == 1.0
    errored = _game(tool_bonus=0.1)
    errored.step("<calc>1/0</calc>")
    assert errored.step("Answer: 396").reward == 1.0


def test_prompts_and_example_turns():
    game = MathToolGame()
    assert "<calc>" in game.get_system_prompt() and "Answer:" in game.get_system_prompt()
    assert game.get_example_turns() == [
        {"role": "user", "content": "What is 17 * 23?"},
        {"role": "assistant", "content": "<calc>17 * 23</calc>"},
        {"role": "user", "content": "<result>391</result>"},
        {"role": "assistant", "content": "Answer: 391"},
    ]
    assert MathToolGame(few_shot=0).get_example_turns() == []
    assert [t["role"] for t in MathToolGame(few_shot=2).get_example_turns()][-2:] == ["user", "assistant"]
    with pytest.raises(ValueError):
        MathToolGame(few_shot=5)


# -- tasks -----------------------------------------------------------------------------------
def _draw(seed, n=200, **config):
    rng = np.random.default_rng(seed)
    return [MathToolGame.generate_task(rng, **config) for _ in range(n)]


def test_generated_tasks_are_deterministic_and_exact():
    tasks = _draw(0, word_problems=True)
    assert tasks == _draw(0, word_problems=True) and tasks != _draw(1, word_problems=True)
    plain = [t for t in tasks if t["question"].startswith("What is ")]
    words = [t for t in tasks if not t["question"].startswith("What is ")]
    assert plain and words
    for task in plain:
        expr = task["question"].removeprefix("What is ").removesuffix("?")
        tokens = expr.split()
        assert len(tokens) in (3, 5) and all(2 <= int(x) <= 99 for x in tokens[::2])
        assert set(tokens[1::2]) <= {"+", "-", "*"}
        assert type(task["answer"]) is int and task["answer"] == eval(expr)  # test-side check of trusted text only
    assert all(type(t["answer"]) is int and t["answer"] >= 0 for t in words)
    assert all(t["question"].startswith("What is ") for t in _draw(0, n=50))  # word problems are opt-in


def test_generator_config():
    for task in _draw(2, n=50, low=1, high=5, operations=["+"]):
        assert "-" not in task["question"] and "*" not in task["question"]
        assert task["answer"] == sum(int(x) for x in task["question"][8:-1].split(" + "))
    words = [t for t in _draw(3, n=50, operations=["*"], word_problems=True) if "apples" in t["question"]]
    a, b = (int(w) for w in words[0]["question"].split() if w.isdigit())
    assert words[0]["answer"] == a * b
    with pytest.raises(ValueError):
        MathToolGame.generate_task(np.random.default_rng(0), operations=["/"])


def test_example_spec_builds_its_environment():
    spec = load_spec("examples/math_tool_grpo.yaml")
    assert spec.rollout.max_turns == 4 and spec.env.game == "envs.math_tool:MathToolGame"
    env = GameEnvironment(import_game(spec.env.game), spec)
    assert len(env.validation_tasks()) == 64 and len(env.train_tasks(8)) == 8
    assert isinstance(env.make_game(), MathToolGame)


# -- through the agent loop ------------------------------------------------------------------
def _assert_masks_exact(traj):
    sampled = {i for t in traj.turns for i in range(t.sampled_start, t.sampled_end)}
    assert traj.loss_mask == [1 if i in sampled else 0 for i in range(len(traj.token_ids))]
    assert len(traj.loss_mask) == len(traj.token_ids) == len(traj.sampling_logprobs)
    assert traj.num_sampled == sum(t.sampled_end - t.sampled_start for t in traj.turns) > 0


class ScriptedEngine:
    """Replies with fixed texts, one per turn, as if the policy sampled them and stopped."""

    policy_version = 0

    def __init__(self, tok, replies):
        self.tok, self.replies, self.turn = tok, replies, 0

    def generate(self, prompts, params, budgets=None, **_):
        ids = self.tok(self.replies[self.turn], add_special_tokens=False)["input_ids"] + [self.tok.eos_token_id]
        self.turn += 1
        return [Completion(token_ids=list(ids), logprobs=[0.0] * len(ids), finish_reason="stop") for _ in prompts]


def test_tool_episode_through_the_agent_loop(tiny):
    _, tok = tiny
    chat = ChatFormat(tok)
    engine = ScriptedEngine(tok, ["<calc>17 * 23</calc>", "<calc>391 + 5</calc>", "Answer: 396"])
    (traj,) = run_episodes(engine, chat, [MathToolGame()], [TASK], SamplingParams(max_new_tokens=32), EpisodeLimits(max_turns=4, max_total_tokens=512))
    assert not traj.failed and traj.stop_reason == "done" and traj.reward == 1.0
    assert [t.observation for t in traj.turns] == ["<result>391</result>", "<result>396</result>", "Correct."]
    assert traj.info == _info(True, 396, calls=2, format_ok=True)
    _assert_masks_exact(traj)
    text = tok.decode(traj.token_ids)
    assert text.endswith("<|im_start|>user\n<result>396</result><|im_end|>\n<|im_start|>assistant\nAnswer: 396<|im_end|>")


def test_tiny_model_episodes_complete(tiny):
    model, tok = tiny
    torch.manual_seed(0)
    engine = HFRolloutEngine(model, tok)
    tasks = _draw(0, n=4, word_problems=True)
    limits = EpisodeLimits(max_turns=3, max_total_tokens=512)
    trajs = run_episodes(engine, ChatFormat(tok), [MathToolGame() for _ in tasks], tasks, SamplingParams(max_new_tokens=8), limits)
    for traj, task in zip(trajs, tasks):
        assert not traj.failed and traj.stop_reason in ("done", "max_turns") and 1 <= len(traj.turns) <= 3
        assert traj.info["expected"] == task["answer"] and traj.reward in (0.0, 1.0)
        _assert_masks_exact(traj)


class TeacherForcedEngine:
    """The real model 'samples' fixed replies: each reply's logprobs are those the model gives its
    tokens under softmax(logits / T), conditioned on the prompt exactly as the loop passed it, so
    the trainer must reproduce them from the finished multi-turn record (nothing re-tokenized)."""

    policy_version = 0

    def __init__(self, model, tok, replies, temperature):
        self.model, self.tok, self.replies, self.temperature = model, tok, replies, temperature
        self.prompts: list[list[int]] = []

    @torch.no_grad()
    def generate(self, prompts, params, budgets=None, **_):
        out = []
        for prompt in prompts:
            reply = self.tok(self.replies[len(self.prompts)], add_special_tokens=False)["input_ids"] + [self.tok.eos_token_id]
            self.prompts.append(list(prompt))
            logits = self.model(input_ids=torch.tensor([prompt + reply])).logits[0, len(prompt) - 1 : -1].float()
            lps = torch.log_softmax(logits / self.temperature, dim=-1).gather(-1, torch.tensor(reply)[:, None]).squeeze(-1)
            out.append(Completion(token_ids=reply, logprobs=lps.tolist(), finish_reason="stop"))
        return out


def test_tool_call_record_is_token_exact_and_its_logprobs_recompute(tiny):
    """Two calculator calls, a malformed call and an answer: record = prompt + sampled + observation
    deltas, mask 1 exactly on sampled tokens, and the trainer's recomputed logprobs match (fp32)."""
    from opentinker.backend import PolicyTrainer
    from opentinker.core.spec import AlgorithmSpec, LoraSpec, OptimizationSpec

    model, tok = tiny
    torch.manual_seed(0)
    trainer = PolicyTrainer(model, tok, LoraSpec(r=4), AlgorithmSpec(), OptimizationSpec(), temperature=0.8)
    replies = ["<calc>17 * 23</calc>", "<calc>391 +</calc>", "<calc>391 + 5</calc>", "Answer: 396"]
    engine = TeacherForcedEngine(trainer.model, tok, replies, temperature=0.8)
    chat = ChatFormat(tok)
    (traj,) = run_episodes(engine, chat, [MathToolGame()], [TASK], SamplingParams(max_new_tokens=32, temperature=0.8),
                           EpisodeLimits(max_turns=5, max_total_tokens=1024))
    assert traj.reward == 1.0 and traj.info == _info(True, 396, calls=3, errors=1, format_ok=True)
    observations = [t.observation for t in traj.turns]
    assert observations[0] == "<result>391</result>" and observations[1].startswith("<error>") and observations[2] == "<result>396</result>"
    # rebuild the record: each generation continued it as it stood, observations are template deltas
    expected, mask = list(traj.prompt_ids), [0] * len(traj.prompt_ids)
    for k, (prompt, reply) in enumerate(zip(engine.prompts, replies)):
        assert prompt == expected
        ids = tok(reply, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        expected, mask = expected + ids, mask + [1] * len(ids)
        if k < len(replies) - 1:
            obs = chat.observation_ids(observations[k], policy_stopped=True)
            expected, mask = expected + obs, mask + [0] * len(obs)
    assert traj.token_ids == expected and traj.loss_mask == mask
    _assert_masks_exact(traj)
    # the record's text is the chat template of the conversation
    assert tok.apply_chat_template(traj.messages, tokenize=False).startswith(tok.decode(traj.token_ids))
    (recomputed,) = trainer.logprobs([traj])
    sampled = [lp for lp, m in zip(traj.sampling_logprobs, traj.loss_mask) if m]
    assert len(sampled) == len(recomputed) == traj.num_sampled
    assert max(abs(a - b) for a, b in zip(sampled, recomputed)) < 1e-4


def test_tool_latency_is_heavy_tailed_seeded_and_waits_only_on_calls():
    """The calculator as a remote tool: lognormal waits with the stated mean, the same draws for the
    same (seed, question, call), none for an answer."""
    import statistics
    import time

    from envs.math_tool.game import ToolLatency

    latency = ToolLatency("lognormal", mean_s=0.5, sigma=1.0)
    draws = [latency.draw(f"What is {i} + 1?", 1) for i in range(4000)]
    assert abs(statistics.mean(draws) - 0.5) < 0.05 and statistics.median(draws) < 0.35 < max(draws) / 10  # mean 0.5, a long tail
    assert draws[:5] == [latency.draw(f"What is {i} + 1?", 1) for i in range(5)]
    assert latency.draw("What is 1 + 1?", 2) != latency.draw("What is 1 + 1?", 1)
    assert ToolLatency("lognormal", seed=1).draw("What is 1 + 1?", 1) != latency.draw("What is 1 + 1?", 1)
    game = MathToolGame(tool_latency={"distribution": "fixed", "mean_s": 0.3})
    game.reset(question="What is 2 + 3?", answer=5)
    start = time.monotonic()
    game.step("Answer: 5")
    assert time.monotonic() - start < 0.2  # an answer is no tool call
    start = time.monotonic()
    game.step("<calc>2 + 3</calc>")
    assert time.monotonic() - start >= 0.3
    with pytest.raises(ValueError, match="tool_latency.distribution 'pareto'"):
        MathToolGame(tool_latency={"distribution": "pareto"})
