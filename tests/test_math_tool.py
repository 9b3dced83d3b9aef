"""The calculator refuses everything but bounded arithmetic; the calculator is a declared tool the
agent loop answers (hermes `<tool_call>` blocks for SmolLM2, whose template renders no tools), the
game's step sees only the answer turns; episodes run through the real agent loop with exact masks."""

import json

import numpy as np
import pytest
import torch

from envs.math_tool import CalcError, MathToolGame, calculate, format_number, safe_eval
from envs.math_tool.game import EXAMPLES
from opentinker.agent import ChatFormat, EpisodeLimits, run_episodes
from opentinker.backend import HFRolloutEngine, SamplingParams
from opentinker.backend.rollout import Completion
from opentinker.env import GameEnvironment
from opentinker.env.environment import import_game
from opentinker.core.spec import load_spec
from opentinker.tools.declared import ToolError, ToolResult
from tests.rounding import same_logprobs

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


# -- the game and its tool ---------------------------------------------------------------------
def _game(**kwargs):
    game = MathToolGame(**kwargs)
    assert game.reset(**TASK) == TASK["question"]
    return game


def _info(correct=False, answer=None, calls=0, invalid=0, errors=0, format_ok=False):
    """The game's info (correct, answer, expected, format_ok) with the agent loop's tool counts."""
    return {"correct": correct, "answer": answer, "expected": 396, "format_ok": format_ok,
            "tool_calls": calls, "tool_invalid": invalid, "tool_errors": errors}


def _game_info(**kwargs):
    return {k: v for k, v in _info(**kwargs).items() if not k.startswith("tool_")}


def test_step_sees_answers_only():
    right = _game().step("Answer: 396")
    assert (right.done, right.reward, right.info) == (True, 1.0, _game_info(correct=True, answer=396, format_ok=True))
    wrong = _game().step("I think Answer: 400")
    assert (wrong.done, wrong.reward, wrong.info) == (True, 0.0, _game_info(answer=400, format_ok=True))
    none = _game().step("The answer is 396.")
    assert (none.done, none.reward, none.info) == (True, 0.0, _game_info())


def test_the_calculator_is_a_declared_tool():
    game = _game(max_tool_calls=2)
    (tool,) = game.get_tools()
    schema = tool.schema()["function"]
    assert schema["name"] == "calculator" and schema["parameters"]["required"] == ["expression"]
    assert schema["parameters"]["additionalProperties"] is False
    assert tool.run({"expression": "17 * 23"}) == "391"
    with pytest.raises(ToolError, match="division by zero"):
        tool.run({"expression": "17 / 0"})
    with pytest.raises(ToolError, match="tool call limit reached; give your answer"):
        tool.run({"expression": "1 + 1"})
    assert (game.calls, game.results) == (3, 1)
    game.reset(**TASK)
    assert (game.calls, game.results) == (0, 0) and game.calculate({"expression": "1 + 1"}) == "2"


def test_prompts_and_example_turns():
    game = MathToolGame()
    assert "calculator" in game.get_system_prompt() and "Answer:" in game.get_system_prompt()
    assert "<calc>" not in game.get_system_prompt()
    assert game.get_example_turns() == [
        {"role": "user", "content": "What is 17 * 23?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "17 * 23"}}}]},
        {"role": "tool", "name": "calculator", "content": "391"},
        {"role": "assistant", "content": "Answer: 391"},
    ]
    assert MathToolGame(few_shot=0).get_example_turns() == []
    assert MathToolGame(few_shot=2).get_example_turns()[-2:] == EXAMPLES[1]
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
CALL = "<tool_call>\n{}\n</tool_call>"


def _call(expression, name="calculator", **extra):
    """A call in the hermes default format (what SmolLM2 is shown: its own template renders no tools)."""
    return CALL.format(json.dumps({"name": name, "arguments": {"expression": expression, **extra}}))


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


@pytest.fixture(scope="module")
def tok():
    """The real SmolLM2 tokenizer (the `tiny` fixture's), without a model: scripted turns need none."""
    from transformers import AutoTokenizer

    from opentinker.model.loading import tokenizer_path

    return AutoTokenizer.from_pretrained(tokenizer_path())


def _play(tok, replies, game=None, max_turns=6):
    engine = ScriptedEngine(tok, replies)
    (traj,) = run_episodes(engine, ChatFormat(tok), [game or MathToolGame()], [TASK], SamplingParams(max_new_tokens=64),
                           EpisodeLimits(max_turns=max_turns, max_total_tokens=2048))
    assert not traj.failed, traj.failure
    assert engine.turn == len(replies) == len(traj.turns)  # every scripted turn was played, no more
    _assert_masks_exact(traj)
    return traj


def _tool_answers(traj):
    """The `tool` messages of the episode itself (after its question: the example's are not counted)."""
    start = traj.messages.index({"role": "user", "content": TASK["question"]})
    return [m["content"] for m in traj.messages[start:] if m["role"] == "tool"]


def test_tool_episode_through_the_agent_loop(tok):
    traj = _play(tok, [_call("17 * 23"), _call("391 + 5"), "Answer: 396"])
    assert traj.stop_reason == "done" and traj.reward == 1.0
    assert [t.observation for t in traj.turns] == ["[calculator] 391", "[calculator] 396", "Correct."]
    assert traj.info == _info(True, 396, calls=2, format_ok=True)
    assert _tool_answers(traj) == ["391", "396"]
    assert [m["role"] for m in traj.messages[-5:]] == ["assistant", "tool", "assistant", "tool", "assistant"]
    text = tok.decode(traj.token_ids)
    assert text.endswith("<|im_start|>user\n<tool_response>\n396\n</tool_response><|im_end|>\n"
                         "<|im_start|>assistant\nAnswer: 396<|im_end|>")
    assert "<|im_start|>tool" not in text  # tool messages are user turns in the hermes format


def test_prompt_renders_the_tools_and_the_example_call(tok):
    traj = _play(tok, ["Answer: 396"])
    prompt = tok.decode(traj.prompt_ids)
    assert prompt.index("Give the final answer as 'Answer: <number>'.") < prompt.index("# Tools") < prompt.index("<tools>")
    assert '"name": "calculator"' in prompt and '"required": ["expression"]' in prompt
    example = ('<|im_start|>user\nWhat is 17 * 23?<|im_end|>\n<|im_start|>assistant\n<tool_call>\n'
               '{"name": "calculator", "arguments": {"expression": "17 * 23"}}\n</tool_call><|im_end|>\n'
               '<|im_start|>user\n<tool_response>\n391\n</tool_response><|im_end|>\n'
               '<|im_start|>assistant\nAnswer: 391<|im_end|>\n<|im_start|>user\nWhat is 17 * 23 + 5?<|im_end|>')
    assert example in prompt and prompt.endswith("<|im_start|>assistant\n")
    bare = _play(tok, ["Answer: 396"], MathToolGame(few_shot=0))
    bare_prompt = tok.decode(bare.prompt_ids)
    assert "<tools>" in bare_prompt and "<tool_response>" not in bare_prompt and "17 * 23?" not in bare_prompt


@pytest.mark.parametrize("reply, message, invalid", [
    ('<tool_call>\n{"name": "calculator", "arguments": {"expression": "17 * 23"}\n</tool_call>', "is not valid JSON", 1),
    ('<tool_call>\n["calculator", "17 * 23"]\n</tool_call>', 'must be an object {"name"', 1),
    (_call("17 * 23", name="calc"), 'there is no tool named "calc" (tools: calculator)', 1),
    (CALL.format('{"name": "calculator", "arguments": {}}'), "'expression' is a required property", 1),
    (_call("17 * 23", precision=2), "Additional properties are not allowed ('precision'", 1),
    (CALL.format('{"name": "calculator", "arguments": {"expression": 391}}'), "expression: 391 is not of type 'string'", 1),
    (_call("17 / 0"), "division by zero", 0),  # well formed: the calculator refuses
    (_call("__import__('os')"), "only numbers", 0),
])
def test_malformed_calls_get_an_error_tool_message(tok, reply, message, invalid):
    traj = _play(tok, [reply, "Answer: 396"])
    (answer,) = _tool_answers(traj)
    assert answer.startswith("error: ") and message in answer
    assert traj.turns[0].observation.endswith(answer)
    assert traj.reward == 1.0 and traj.stop_reason == "done"  # the episode goes on to its answer
    assert traj.info == _info(True, 396, calls=1, invalid=invalid, errors=1, format_ok=True)


def test_more_calls_in_a_turn_than_allowed(tok):
    game = MathToolGame(max_tool_calls=10)
    traj = _play(tok, ["\n".join(_call(f"{i} + 1") for i in range(5)), "Answer: 396"], game)
    assert _tool_answers(traj) == ["1", "2", "3", "4", "error: at most 4 tool calls a turn; this one was not run"]
    assert game.calls == 4  # the fifth never reached the calculator
    assert traj.info == _info(True, 396, calls=5, invalid=1, errors=1, format_ok=True)
    text = tok.decode(traj.token_ids)
    assert "<tool_response>\n4\n</tool_response>\n<tool_response>\nerror: at most 4" in text  # one user turn for the five


def test_call_limit(tok):
    traj = _play(tok, [_call("1 + 1")] * 3 + ["Answer: 396"], MathToolGame(max_tool_calls=2))
    assert _tool_answers(traj) == ["2", "2", "error: tool call limit reached; give your answer"]
    assert traj.info == _info(True, 396, calls=3, errors=1, format_ok=True)  # over the limit is a failed call, not a malformed one
    none = _play(tok, [_call("1"), "Answer: 396"], MathToolGame(max_tool_calls=0))
    assert _tool_answers(none) == ["error: tool call limit reached; give your answer"]


def test_a_call_beside_an_answer_is_a_tool_turn(tok):
    """A turn that calls the tool goes to the tools, not the game, whatever else it says."""
    traj = _play(tok, [_call("17 * 23 + 5") + "\nAnswer: 396", "Answer: 396"])
    assert [t.observation for t in traj.turns] == ["[calculator] 396", "Correct."]
    assert traj.info == _info(True, 396, calls=1, format_ok=True)


def test_no_answer_ends_with_zero(tok):
    traj = _play(tok, ["The answer is 396."])
    assert (traj.stop_reason, traj.reward, traj.info) == ("done", 0.0, _info())
    after_a_call = _play(tok, [_call("17 * 23 + 5"), "It is 396."])
    assert (after_a_call.reward, after_a_call.info) == (0.0, _info(calls=1))


def test_out_of_turns_on_a_call(tok):
    """An episode whose last turn is a call ends at max_turns without the game's step: no reward,
    and only the loop's counts in its info."""
    traj = _play(tok, [_call("1 + 1"), _call("2 + 2")], max_turns=2)
    assert (traj.stop_reason, traj.reward) == ("max_turns", 0.0)
    assert traj.info == {"tool_calls": 2, "tool_invalid": 0, "tool_errors": 0}


def test_tool_bonus_is_paid_only_after_a_call_that_returned_a_result(tok):
    assert _play(tok, [_call("17 * 23 + 5"), "Answer: 1"], _game(tool_bonus=0.1)).reward == pytest.approx(0.1)  # a hacking risk
    assert _play(tok, [_call("17 * 23 + 5"), "Answer: 396"], _game(tool_bonus=0.1)).reward == pytest.approx(1.1)
    assert _play(tok, ["Answer: 396"], _game(tool_bonus=0.1)).reward == 1.0
    for failed in (_call("1 / 0"), _call("1", name="calc"), '<tool_call>{"name": </tool_call>'):
        assert _play(tok, [failed, "Answer: 396"], _game(tool_bonus=0.1)).reward == 1.0
    over = _play(tok, [_call("1 + 1"), "Answer: 396"], _game(tool_bonus=0.1, max_tool_calls=0))
    assert over.reward == 1.0 and over.info["tool_errors"] == 1


def test_tiny_model_episodes_complete(tiny):
    model, tok = tiny
    torch.manual_seed(0)
    engine = HFRolloutEngine(model, tok)
    tasks = _draw(0, n=4, word_problems=True)
    limits = EpisodeLimits(max_turns=3, max_total_tokens=768)
    trajs = run_episodes(engine, ChatFormat(tok), [MathToolGame() for _ in tasks], tasks, SamplingParams(max_new_tokens=8), limits)
    for traj, task in zip(trajs, tasks):
        assert not traj.failed and traj.stop_reason in ("done", "max_turns") and 1 <= len(traj.turns) <= 3
        assert traj.reward in (0.0, 1.0) and {"tool_calls", "tool_invalid", "tool_errors"} <= set(traj.info)
        if traj.stop_reason == "done":
            assert traj.info["expected"] == task["answer"]
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
    """Two calculator calls, a refused one, a malformed one and an answer: record = prompt + sampled
    + tool-result deltas, mask 1 exactly on sampled tokens, and the trainer's recomputed logprobs
    match (fp32)."""
    from opentinker.backend import PolicyTrainer
    from opentinker.core.spec import AlgorithmSpec, LoraSpec, OptimizationSpec

    model, tok = tiny
    torch.manual_seed(0)
    trainer = PolicyTrainer(model, tok, LoraSpec(r=4), AlgorithmSpec(), OptimizationSpec(), temperature=0.8)
    replies = [_call("17 * 23"), _call("391 +"), '<tool_call>\n{"name": "calculator", "arguments": }\n</tool_call>',
               _call("391 + 5"), "Answer: 396"]
    engine = TeacherForcedEngine(trainer.model, tok, replies, temperature=0.8)
    chat = ChatFormat(tok)
    game = MathToolGame()
    (traj,) = run_episodes(engine, chat, [game], [TASK], SamplingParams(max_new_tokens=64, temperature=0.8),
                           EpisodeLimits(max_turns=6, max_total_tokens=2048))
    assert traj.reward == 1.0 and traj.info == _info(True, 396, calls=4, invalid=1, errors=2, format_ok=True)
    answers = _tool_answers(traj)
    assert answers[0] == "391" and answers[1] == "error: syntax error" and answers[2].startswith("error: tool call 1 is not valid JSON")
    assert answers[3] == "396"
    # rebuild the record: each generation continued it as it stood, tool results are template deltas
    expected, mask = list(traj.prompt_ids), [0] * len(traj.prompt_ids)
    for k, (prompt, reply) in enumerate(zip(engine.prompts, replies)):
        assert prompt == expected
        ids = tok(reply, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        expected, mask = expected + ids, mask + [1] * len(ids)
        if k < len(replies) - 1:
            obs = chat.tool_results_ids([ToolResult("calculator", answers[k])], policy_stopped=True)
            expected, mask = expected + obs, mask + [0] * len(obs)
    assert traj.token_ids == expected and traj.loss_mask == mask
    _assert_masks_exact(traj)
    # the record's text is the conversation rendered with its tools (the hermes default over SmolLM2's template)
    schemas = [t.schema() for t in game.get_tools()]
    assert chat.tools.render(traj.messages, schemas, add_generation_prompt=False).startswith(tok.decode(traj.token_ids))
    (recomputed,) = trainer.logprobs([traj])
    sampled = [lp for lp, m in zip(traj.sampling_logprobs, traj.loss_mask) if m]
    assert len(sampled) == len(recomputed) == traj.num_sampled
    assert same_logprobs(sampled, recomputed)  # decoding against one pass: other orders (tests/rounding.py)


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
    assert game.calculate({"expression": "2 + 3"}) == "5"
    assert time.monotonic() - start >= 0.3
    with pytest.raises(ValueError, match="tool_latency.distribution 'pareto'"):
        MathToolGame(tool_latency={"distribution": "pareto"})
