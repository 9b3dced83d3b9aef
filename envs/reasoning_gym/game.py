"""reasoning-gym's datasets as single-turn games, scored by the datasets' own `score_answer`.

A task is an index into one seeded reasoning-gym dataset (a CompositeDataset for a weighted mix),
drawn by the job's generator: `reset` regenerates the entry from the package itself, so what is
scored is what the package produced, never data that travelled with the task. The model's answer
is taken from its text as reasoning-gym documents it (`extract_answer`: the last
`<answer>...</answer>`), under reasoning-gym's own default system prompt; both can be changed
(`game_kwargs: {system_prompt, answer_tag}`), and `few_shot` example exchanges (the pool's last
items, answered in the tag) may come first: a small model that ignores the prompt's format often
follows an example. The reward is the score, 0 to 1 (some datasets give
partial credit); `correct` is a score of 1.

A spec names it `env: {source: reasoning_gym, dataset: <name or {name: weight}>, config: {...}}`
(opentinker.core.env_sources resolves and checks that before submission).
"""

from __future__ import annotations

import re
import threading
from typing import Any

from opentinker.core.env_sources import MAX_FEW_SHOT, POOL_SIZE, build_dataset
from opentinker.env import AbstractGame, StepResult

_TAG = re.compile(r"[A-Za-z_][A-Za-z0-9_-]{0,31}")
_GENERATING = threading.Lock()
"""Episodes reset in threads over one cached dataset; a few datasets draw from shared state (numpy's
global generator, an instance's own) while generating an item, so one item is generated at a time."""


class ReasoningGymGame(AbstractGame):
    """One reasoning-gym question per episode. `system_prompt`: a name of reasoning-gym's
    SYSTEM_PROMPTS (default, DeepSeekZero, simple, direct, chain_of_draft) or your own text;
    `answer_tag`: the tag the answer is read from (say it in your prompt if you change it);
    `few_shot`: how many example exchanges (a question, its answer in the tag) come first."""

    def __init__(self, system_prompt: str = "default", answer_tag: str = "answer", few_shot: int = 0):
        from reasoning_gym.utils import SYSTEM_PROMPTS

        if not _TAG.fullmatch(answer_tag):
            raise ValueError(f"answer_tag: a tag name like 'answer', got {answer_tag!r}")
        if not 0 <= few_shot <= MAX_FEW_SHOT:
            raise ValueError(f"few_shot: 0 to {MAX_FEW_SHOT}, got {few_shot!r}")
        self.few_shot = few_shot
        self.system_prompt = SYSTEM_PROMPTS.get(system_prompt, system_prompt)
        self.answer_tag = answer_tag
        self.pool: Any = None
        self.entry: dict[str, Any] = {}

    @classmethod
    def generate_task(cls, rng: Any, rg_dataset: Any = None, size: int = POOL_SIZE, **config: Any) -> dict[str, Any]:
        config = {**config, "size": int(size)}
        build_dataset(rg_dataset, config)  # a bad config stops the job here, in reasoning-gym's words
        return {"dataset": rg_dataset, "config": config, "index": int(rng.integers(config["size"]))}

    def get_system_prompt(self) -> str:
        return self.system_prompt

    def get_example_turns(self) -> list[dict[str, str]]:
        """The pool's last `few_shot` items as answered exchanges (read after reset, which builds the pool)."""
        if not self.few_shot or self.pool is None:
            return []
        with _GENERATING:
            items = [self.pool[len(self.pool) - 1 - k] for k in range(self.few_shot)]
        tag = self.answer_tag
        return [turn for item in items for turn in ({"role": "user", "content": item["question"]},
                                                    {"role": "assistant", "content": f"<{tag}>{item['answer']}</{tag}>"})]

    def reset(self, dataset: Any, config: dict[str, Any], index: int, **_: Any) -> str:
        self.pool = build_dataset(dataset, config)
        with _GENERATING:
            self.entry = self.pool[int(index)]
        return self.entry["question"]

    def step(self, action: str) -> StepResult:
        from reasoning_gym.utils import extract_answer

        answer = extract_answer(action, tag_name=self.answer_tag)
        score = float(self.pool.score_answer(answer, self.entry))
        info = {"correct": score >= 1.0, "format_ok": answer is not None, "answer": answer,
                "expected": self.entry["answer"], "source_dataset": self.entry["metadata"].get("source_dataset")}
        return StepResult(observation="", reward=score, done=True, info=info)
