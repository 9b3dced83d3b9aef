"""Multi-turn arithmetic where the model may call a calculator before it answers.

The calculator is a declared tool (`get_tools`: an OpenAI function schema), so the model calls it
in its chat template's own format, or the default hermes format where the template has none
(opentinker/tools/formats.py), and the agent loop answers the call with a `tool` message:

    assistant: <tool_call>
               {"name": "calculator", "arguments": {"expression": "17 * 23"}}
               </tool_call>
    user:      <tool_response>
               391
               </tool_response>
    assistant: Answer: 391                 (ends the episode)

The game sees only the turns without a call: `Answer: N` ends the episode (reward 1 if N is
right, else 0); a turn with neither a call nor an answer ends it with reward 0. After
`max_tool_calls` calls in an episode every further call gets an error. A malformed call (not JSON,
an unknown tool, a missing expression) is answered with an error by the agent loop, and counted.

`tool_bonus` (off by default) is added to the final reward when a call returned a result. Like a
format bonus it invites reward hacking (calling the tool on anything, then answering whatever),
so watch accuracy and `tool_calls` beside reward when using it.

`tool_latency` makes the calculator stand in for a remote tool (a web or API call, code run
elsewhere): each call waits a drawn time before it answers, heavy-tailed as such calls are.
`{"distribution": "lognormal", "mean_s": 0.5, "sigma": 1.0}` draws exp(N(mu, sigma)) seconds with
mu = ln(mean_s) - sigma^2 / 2 (so the mean is mean_s); `"fixed"` waits mean_s. Seeded: the n-th
call of an episode waits the time drawn from (`seed`, the question, n), so the same problems wait
the same times in every run (the benchmarks compare ways on equal footing).
"""

from __future__ import annotations

import math
import random
import time
import zlib
from typing import Any

from envs.math import parse_answer
from envs.math_tool.calculator import ALLOWED, calculate, safe_eval
from opentinker.env import AbstractGame, StepResult
from opentinker.tools.declared import Tool, ToolError

SYSTEM_PROMPT = ("Solve the arithmetic problem. You may use the calculator tool. "
                 "Give the final answer as 'Answer: <number>'.")
CALCULATOR = {"type": "object", "properties": {"expression": {"type": "string", "description": f"arithmetic: {ALLOWED}"}},
              "required": ["expression"], "additionalProperties": False}


def _call(expression: str) -> dict[str, Any]:
    return {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {"name": "calculator",
                                                                                                "arguments": {"expression": expression}}}]}


EXAMPLES = [
    [{"role": "user", "content": "What is 17 * 23?"}, _call("17 * 23"), {"role": "tool", "name": "calculator", "content": "391"},
     {"role": "assistant", "content": "Answer: 391"}],
    [{"role": "user", "content": "What is 8 + 5?"}, {"role": "assistant", "content": "Answer: 13"}],  # the calculator is optional
]
_OPERATIONS = ("+", "-", "*")
# (operations used, question, expression giving the answer); a, b, c are drawn operands.
WORD_PROBLEMS = [
    ("*", "A box holds {a} rows of {b} apples. How many apples are in the box?", "{a} * {b}"),
    ("+", "Sam has {a} marbles and wins {b} more. How many marbles does Sam have?", "{a} + {b}"),
    ("-", "A shelf holds {a} books and {b} are taken away. How many books are left?", "{a} - {b}"),
    ("*+", "A farm has {a} pens of {b} sheep and {c} more sheep in a field. How many sheep are there?", "{a} * {b} + {c}"),
]


class MathToolGame(AbstractGame):
    """One arithmetic question per episode; calculator calls are extra turns the agent loop answers."""

    def __init__(self, few_shot: int = 1, max_tool_calls: int = 3, tool_bonus: float = 0.0, system_prompt: str = SYSTEM_PROMPT,
                 tool_latency: dict[str, Any] | None = None):
        if not 0 <= few_shot <= len(EXAMPLES):
            raise ValueError(f"few_shot must be between 0 and {len(EXAMPLES)}")
        if max_tool_calls < 0:
            raise ValueError("max_tool_calls must be >= 0")
        self.latency = ToolLatency(**(tool_latency or {"distribution": "none"}))
        self.few_shot = few_shot
        self.max_tool_calls = max_tool_calls
        self.tool_bonus = tool_bonus
        self.system_prompt = system_prompt
        self.question, self.answer = "", 0
        self.calls = self.results = 0

    @classmethod
    def generate_task(cls, rng: Any, low: int = 2, high: int = 99, operations: list[str] | tuple[str, ...] = _OPERATIONS,
                      word_problems: bool = False) -> dict[str, Any]:
        """A question with two or three operands in [low, high]; the answer comes from the calculator itself."""
        ops = [str(op) for op in operations]
        if not ops or any(op not in _OPERATIONS for op in ops):
            raise ValueError(f"operations must be some of {list(_OPERATIONS)}, got {ops}")
        if low > high:
            raise ValueError("low must be <= high")
        a, b, c = (int(x) for x in rng.integers(low, high + 1, size=3))
        fitting = [w for w in WORD_PROBLEMS if set(w[0]) <= set(ops)]
        if word_problems and fitting and rng.random() < 0.5:
            _, text, expr = fitting[int(rng.integers(len(fitting)))]
            a, b = max(a, b), min(a, b)  # "taken away" never goes below zero
            question, expr = text.format(a=a, b=b, c=c), expr.format(a=a, b=b, c=c)
        else:
            picked = [ops[int(i)] for i in rng.integers(len(ops), size=int(rng.integers(1, 3)))]
            expr = " ".join([str(a)] + [f"{op} {x}" for op, x in zip(picked, (b, c))])
            question = f"What is {expr}?"
        return {"question": question, "answer": int(safe_eval(expr))}

    def get_system_prompt(self) -> str:
        return self.system_prompt

    def get_example_turns(self) -> list[dict[str, Any]]:
        return [turn for example in EXAMPLES[: self.few_shot] for turn in example]

    def get_tools(self) -> list[Tool]:
        return [Tool("calculator", "Evaluate an arithmetic expression.", self.calculate, CALCULATOR, timeout_s=60.0)]

    def reset(self, question: str, answer: int, **_: Any) -> str:
        self.question, self.answer = question, int(answer)
        self.calls = self.results = 0
        return question

    def calculate(self, arguments: dict[str, Any]) -> str:
        """The calculator tool: the value, or a ToolError the model reads."""
        self.calls += 1
        time.sleep(self.latency.draw(self.question, self.calls))
        if self.calls > self.max_tool_calls:
            raise ToolError("tool call limit reached; give your answer")
        ok, text = calculate(arguments["expression"])
        if not ok:
            raise ToolError(text)
        self.results += 1
        return text

    def step(self, action: str) -> StepResult:
        given = parse_answer(action)
        if given is None:
            return self._result("No answer given.", 0.0, False, None)
        correct = given == self.answer
        reward = (1.0 if correct else 0.0) + (self.tool_bonus if self.results else 0.0)
        return self._result("Correct." if correct else f"Incorrect: {self.answer}.", reward, correct, given)

    def _result(self, observation: str, reward: float, correct: bool, given: int | None) -> StepResult:
        info = {"correct": correct, "answer": given, "expected": self.answer, "format_ok": given is not None}
        return StepResult(observation=observation, reward=reward, done=True, info=info)


class ToolLatency:
    """How long a calculator call takes: "none", "fixed" (mean_s) or "lognormal" (mean mean_s,
    log-space spread sigma), drawn per (seed, question, call number)."""

    def __init__(self, distribution: str = "none", mean_s: float = 0.5, sigma: float = 1.0, seed: int = 0):
        if distribution not in ("none", "fixed", "lognormal"):
            raise ValueError(f"tool_latency.distribution {distribution!r}: none, fixed or lognormal")
        if not (math.isfinite(mean_s) and mean_s >= 0 and math.isfinite(sigma) and sigma >= 0):
            raise ValueError("tool_latency: mean_s and sigma must be finite and >= 0")
        self.distribution, self.mean_s, self.sigma, self.seed = distribution, float(mean_s), float(sigma), int(seed)

    def draw(self, question: str, call: int) -> float:
        if self.distribution == "none" or self.mean_s == 0:
            return 0.0
        if self.distribution == "fixed":
            return self.mean_s
        rng = random.Random(zlib.crc32(f"{self.seed}|{question}|{call}".encode()))
        return math.exp(rng.gauss(math.log(self.mean_s) - self.sigma**2 / 2, self.sigma))
