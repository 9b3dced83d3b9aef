"""Generated arithmetic with a strict answer format: the model must end with `Answer: <number>`.

Reward 1 for a correct number in that format, 0 otherwise; `format_reward` (off by default) adds
a small bonus for the format alone. A format bonus invites reward hacking (always answering the
same number in the right format), which is why evaluations report the format rate and the share
of distinct answers beside accuracy.
"""

from __future__ import annotations

import operator
import re
from typing import Any

from opentinker.env import AbstractGame, StepResult

ANSWER_RE = re.compile(r"Answer:\s*(-?\d+)")
_OPS = {"+": operator.add, "-": operator.sub, "*": operator.mul, "/": operator.floordiv}
SYSTEM_PROMPT = "You are a careful calculator. Reply with the result in the form 'Answer: <number>'."
EXAMPLES = [("What is 3 + 4?", "Answer: 7"), ("What is 12 - 5?", "Answer: 7"), ("What is 6 * 3?", "Answer: 18")]


MAX_ANSWER_DIGITS = 30  # far past any answer here; int() of 4,301 digits raises, and no metric wants such a number


def parse_answer(text: str) -> int | None:
    """The number of the last `Answer: N` in the text, or None when the format is missing or N has
    more than MAX_ANSWER_DIGITS digits (leading zeros aside)."""
    found = ANSWER_RE.findall(text)
    if not found:
        return None
    sign, digits = ("-", found[-1][1:]) if found[-1].startswith("-") else ("", found[-1])
    digits = digits.lstrip("0") or "0"
    return int(sign + digits) if len(digits) <= MAX_ANSWER_DIGITS else None


def graded(action: str, expected: int) -> StepResult:
    """The turn that answers a question with one number: reward 1 for `Answer: <expected>`, the
    episode ends either way (the tool-using games' grading)."""
    given = parse_answer(action)
    correct = given is not None and given == expected
    info = {"correct": correct, "answer": given, "expected": expected, "format_ok": given is not None}
    return StepResult("Correct." if correct else f"Incorrect: {expected}.", 1.0 if correct else 0.0, True, info)


class MathGame(AbstractGame):
    """One arithmetic question per episode (single turn)."""

    def __init__(self, few_shot: int = 1, format_reward: float = 0.0, system_prompt: str = SYSTEM_PROMPT):
        if not 0 <= few_shot <= len(EXAMPLES):
            raise ValueError(f"few_shot must be between 0 and {len(EXAMPLES)}")
        self.few_shot = few_shot
        self.format_reward = format_reward
        self.system_prompt = system_prompt
        self.question = ""
        self.answer = 0

    @classmethod
    def generate_task(cls, rng: Any, low: int = 1, high: int = 20, operations: list[str] | tuple[str, ...] = ("+",)) -> dict[str, Any]:
        op = str(operations[int(rng.integers(len(operations)))])
        if op not in _OPS:
            raise ValueError(f"unknown operation {op!r}; use some of {sorted(_OPS)}")
        a, b = (int(x) for x in rng.integers(low, high + 1, size=2))
        if op == "/":
            b = max(b, 1)
            a = a * b  # exact division only
        return {"question": f"What is {a} {op} {b}?", "answer": int(_OPS[op](a, b))}

    def get_system_prompt(self) -> str:
        return self.system_prompt

    def get_example_turns(self) -> list[dict[str, str]]:
        turns = []
        for q, a in EXAMPLES[: self.few_shot]:
            turns += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
        return turns

    def reset(self, question: str, answer: int, **_: Any) -> str:
        self.question, self.answer = question, int(answer)
        return question

    def step(self, action: str) -> StepResult:
        given = parse_answer(action)
        correct = given is not None and given == self.answer
        reward = (1.0 if correct else 0.0) + (self.format_reward if given is not None else 0.0)
        info = {"correct": correct, "format_ok": given is not None, "answer": given, "expected": self.answer}
        return StepResult(observation="Correct." if correct else f"Incorrect: {self.answer}.", reward=reward, done=True, info=info)
