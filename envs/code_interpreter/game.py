"""The reference design's code-interpreter environment: arithmetic and word problems where the
model may call a `python` tool, run in the bubblewrap sandbox (opentinker/tools/sandbox.py), and
read its output before it answers.

    user:      A crate holds 47 boxes of 128 nails. 35 nails are used. How many nails are left?
    assistant: <tool_call>
               {"name": "python", "arguments": {"code": "print(47 * 128 - 35)"}}
               </tool_call>
    user:      <tool_response>
               5981
               </tool_response>
    assistant: Answer: 5981

The tool is declared (`get_tools`) and answered by the agent loop in the policy's own tool-call
format; the game grades only the turn without a call: reward 1 for `Answer: N` with the right N,
0 otherwise. The numbers are chosen so a 135M model cannot work them out in its head (a product
of a 3-digit and a 2-digit number, then one more operation): accuracy needs the tool.
Unlike the reference's sandbox (a Ray actor with no isolation), the code runs with no network,
a read-only system, a tmpfs, an unprivileged user and hard limits.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

from envs.math import graded
from opentinker.env import AbstractGame, StepResult
from opentinker.tools.declared import Tool

SYSTEM_PROMPT = ("Solve the problem. You can run Python code with the python tool: it shows what the code prints. "
                 "Give the final answer as 'Answer: <number>'.")
# (question, expression): a, b in the hundreds and tens, c a small number.
PROBLEMS = [
    ("What is {a} * {b} + {c}?", "{a} * {b} + {c}"),
    ("What is {a} * {b} - {c}?", "{a} * {b} - {c}"),
    ("A crate holds {a} boxes of {b} nails. {c} nails are used. How many nails are left?", "{a} * {b} - {c}"),
    ("A theatre has {a} rows of {b} seats and {c} extra chairs. How many places are there?", "{a} * {b} + {c}"),
    ("A train carries {a} passengers on each of {b} trips, and {c} more on the last one. How many passengers in all?", "{a} * {b} + {c}"),
]


def _call(code: str) -> dict[str, Any]:
    return {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {"name": "python", "arguments": {"code": code}}}]}


EXAMPLE = [{"role": "user", "content": "What is 312 * 47 + 9?"}, _call("print(312 * 47 + 9)"),
           {"role": "tool", "name": "python", "content": "14673"}, {"role": "assistant", "content": "Answer: 14673"}]


@lru_cache(maxsize=8)
def _sandbox(limits: tuple[tuple[str, Any], ...]) -> Any:
    """One runner per limits in a process (its check of bubblewrap runs once)."""
    from opentinker.tools.sandbox import Sandbox, SandboxLimits

    return Sandbox(SandboxLimits(**dict(limits)))


class CodeInterpreterMathGame(AbstractGame):
    """One problem per episode; `python` calls are extra turns the agent loop answers from the sandbox."""

    def __init__(self, few_shot: int = 1, sandbox: dict[str, Any] | None = None, system_prompt: str = SYSTEM_PROMPT):
        if few_shot not in (0, 1):
            raise ValueError("few_shot must be 0 or 1")
        self.few_shot, self.system_prompt = few_shot, system_prompt
        self.limits = tuple(sorted((sandbox or {"wall_s": 5.0, "memory_mb": 256}).items()))
        self.answer = 0

    @classmethod
    def generate_task(cls, rng: Any, low: int = 100, high: int = 999, factor_low: int = 11, factor_high: int = 99,
                      word_problems: bool = True) -> dict[str, Any]:
        a, b, c = int(rng.integers(low, high + 1)), int(rng.integers(factor_low, factor_high + 1)), int(rng.integers(2, 99))
        templates = PROBLEMS if word_problems else PROBLEMS[:2]
        question, expr = templates[int(rng.integers(len(templates)))]
        value = eval(expr.format(a=a, b=b, c=c), {"__builtins__": {}})  # our own template over our own integers
        return {"question": question.format(a=a, b=b, c=c), "answer": int(value)}

    def get_system_prompt(self) -> str:
        return self.system_prompt

    def get_example_turns(self) -> list[dict[str, Any]]:
        return list(EXAMPLE) if self.few_shot else []

    def get_tools(self) -> list[Tool]:
        from opentinker.tools.sandbox import python_tool

        return [python_tool(_sandbox(self.limits))]

    def reset(self, question: str, answer: int, **_: Any) -> str:
        self.answer = int(answer)
        return question

    def step(self, action: str) -> StepResult:
        return graded(action, self.answer)
