"""Multi-turn arithmetic where the model may call a calculator before it answers.

SmolLM2's chat template has no tool-call format, so the tool uses tags inside plain text:

    assistant: <calc>17 * 23</calc>        (call the calculator, one call per turn)
    user:      <result>391</result>        (or <error>MESSAGE</error>)
    assistant: Answer: 391                 (ends the episode)

Each step: a turn with `Answer: N` ends the episode (reward 1 if N is right, else 0; it wins over
a call in the same turn). Otherwise a turn with `<calc>` gets the result or an error as the next
user message (reward 0); after `max_tool_calls` calls every further call gets an error. A turn
with neither ends the episode with reward 0. Only the first call of a turn is evaluated.

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
import re
import time
import zlib
from typing import Any

from envs.math import parse_answer
from envs.math_tool.calculator import calculate, safe_eval
from opentinker.env import AbstractGame, StepResult

CALL_RE = re.compile(r"<calc>(.*?)</calc>", re.DOTALL)
SYSTEM_PROMPT = (
    "Solve the arithmetic problem. You may use a calculator: write <calc>EXPRESSION</calc> "
    "(numbers, + - * / // % ** and parentheses) and the result comes back as <result>VALUE</result>. "
    "Give the final answer as 'Answer: <number>'."
)
EXAMPLES = [
    ["What is 17 * 23?", "<calc>17 * 23</calc>", "<result>391</result>", "Answer: 391"],
    ["What is 8 + 5?", "Answer: 13"],  # the calculator is optional
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
    """One arithmetic question per episode; calculator calls are extra turns."""

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
        self.tool_calls = self.tool_errors = self._tool_results = 0

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

    def get_example_turns(self) -> list[dict[str, str]]:
        roles = ("user", "assistant")
        return [{"role": roles[i % 2], "content": text} for ex in EXAMPLES[: self.few_shot] for i, text in enumerate(ex)]

    def reset(self, question: str, answer: int, **_: Any) -> str:
        self.question, self.answer = question, int(answer)
        self.tool_calls = self.tool_errors = self._tool_results = 0
        return question

    def step(self, action: str) -> StepResult:
        given = parse_answer(action)
        if given is not None:
            correct = given == self.answer
            reward = (1.0 if correct else 0.0) + (self.tool_bonus if self._tool_results else 0.0)
            return self._result("Correct." if correct else f"Incorrect: {self.answer}.", reward, True, correct, given, True)
        if "<calc>" not in action:
            return self._result("No answer given.", 0.0, True, False, None, False)
        self.tool_calls += 1
        time.sleep(self.latency.draw(self.question, self.tool_calls))
        ok, text = self._call(action)
        if ok:
            self._tool_results += 1
        else:
            self.tool_errors += 1
        observation = f"<result>{text}</result>" if ok else f"<error>{text}</error>"
        # format_ok stays False until an answer: an episode cut off by max_turns counts as unformatted.
        return self._result(observation, 0.0, False, False, None, False)

    def _call(self, action: str) -> tuple[bool, str]:
        if self.tool_calls > self.max_tool_calls:
            return False, "tool call limit reached; give your answer"
        match = CALL_RE.search(action)
        if match is None:
            return False, "unclosed <calc> tag: write <calc>EXPRESSION</calc>"
        return calculate(match.group(1))

    def _result(self, observation: str, reward: float, done: bool, correct: bool, given: int | None, format_ok: bool) -> StepResult:
        info = {"correct": correct, "answer": given, "expected": self.answer, "tool_calls": self.tool_calls,
                "tool_errors": self.tool_errors, "format_ok": format_ok}
        return StepResult(observation=observation, reward=reward, done=done, info=info)


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
