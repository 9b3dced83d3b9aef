"""Questions about made-up units ("How many zorbs are 14 wumps?"). The answer is in no model's
weights: the job's MCP server (envs/units/server.py, given as `env.tools: [{mcp: URL}]`) owns
the table, so a policy can only be right by calling its `convert` tool and copying the result:
chance is about 0%. Reward 1 for `Answer: N` with the right N."""

from __future__ import annotations

from typing import Any

from envs.math import graded
from envs.units.table import FACTORS, convert
from opentinker.env import AbstractGame, StepResult

SYSTEM_PROMPT = ("Answer questions about units with the convert tool; you do not know these units yourself. "
                 "Give the final answer as 'Answer: <number>'.")
EXAMPLE = [
    {"role": "user", "content": "How many grains are 5 pecks?"},
    {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {
        "name": "convert", "arguments": {"value": 5, "from_unit": "peck", "to_unit": "grain"}}}]},
    {"role": "tool", "name": "convert", "content": "40"},
    {"role": "assistant", "content": "Answer: 40"},
]


class UnitsGame(AbstractGame):
    def __init__(self, few_shot: int = 1):
        self.few_shot, self.answer = few_shot, 0

    @classmethod
    def generate_task(cls, rng: Any, high: int = 30) -> dict[str, Any]:
        """A conversion with a whole-number answer: `value` of a unit into a smaller one it divides."""
        names = list(FACTORS)
        while True:
            big, small = (names[int(i)] for i in rng.choice(len(names), 2, replace=False))
            if FACTORS[big] > FACTORS[small] and FACTORS[big] % FACTORS[small] == 0 or small == "grain" and big != "grain":
                break
        value = int(rng.integers(2, high + 1))
        return {"question": f"How many {small}s are {value} {big}s?", "answer": int(convert(value, big, small))}

    def get_system_prompt(self) -> str:
        return SYSTEM_PROMPT

    def get_example_turns(self) -> list[dict[str, Any]]:
        return list(EXAMPLE) if self.few_shot else []

    def reset(self, question: str, answer: int, **_: Any) -> str:
        self.answer = int(answer)
        return question

    def step(self, action: str) -> StepResult:
        return graded(action, self.answer)
