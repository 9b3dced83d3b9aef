"""Generated SFT data: chats built from a game's own prompts with a reference reply, as JSONL.

The conversation is exactly what the RL loop shows the policy (system prompt, few-shot turns,
first user message: `opentinker.env.messages.initial_messages`), so SFT teaches the format the RL
reward checks. Tasks come from the environment's training stream, which never repeats its
validation tasks: an RL job with the same environment config and seed evaluates on problems
the SFT data did not contain.

    python -m opentinker.sft.game_chats --n 64 --out runs/data/math_sft.jsonl
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from typing import Any

from opentinker.env import GameEnvironment
from opentinker.env.hosting import start_episode
from opentinker.env.messages import initial_messages


def game_chats(env: GameEnvironment, n: int, reply: Callable[[dict[str, Any]], str]) -> list[dict[str, Any]]:
    """`n` distinct chats from the environment's training stream, each ending with `reply(task)`."""
    rows, seen = [], set()
    for _ in range(n * 50):
        (task,) = env.train_tasks(1)
        key = json.dumps(task, sort_keys=True, default=str)
        if key in seen:
            continue
        seen.add(key)
        game = env.make_game()
        messages = initial_messages(game, start_episode(game, task))
        rows.append({"messages": messages + [{"role": "assistant", "content": reply(task)}]})
        if len(rows) == n:
            return rows
    raise ValueError(f"the environment yields only {len(rows)} distinct training tasks, fewer than {n}")


def math_reply(task: dict[str, Any]) -> str:
    """A worked answer ending in the exact `Answer: N` the MathGame rewards: "3 + 4 = 7\\nAnswer: 7"."""
    expression = task["question"].removeprefix("What is ").removesuffix("?")
    return f"{expression} = {task['answer']}\nAnswer: {task['answer']}"


def math_chats(n: int, seed: int = 0, low: int = 1, high: int = 20, operations: tuple[str, ...] = ("+",),
               few_shot: int = 1, val_size: int = 64) -> list[dict[str, Any]]:
    """Chats for `envs.math:MathGame`; the defaults match examples/math_grpo.yaml's environment."""
    from envs.math import MathGame

    config = {"low": low, "high": high, "operations": list(operations), "val_size": val_size,
              "game_kwargs": {"few_shot": few_shot}, "seed": seed}
    return game_chats(GameEnvironment(MathGame, config), n, math_reply)


def write_jsonl(rows: list[dict[str, Any]], url: str) -> None:
    """Write one JSON object per line through fsspec (a local path or s3://…)."""
    import fsspec

    with fsspec.open(url, "wt", encoding="utf-8", auto_mkdir=True) as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="Write generated math SFT chats as JSONL.")
    p.add_argument("--out", required=True, help="output path or fsspec URL")
    p.add_argument("--n", type=int, default=64, help="number of distinct problems")
    p.add_argument("--seed", type=int, default=0, help="the RL job's seed (its validation set is left out)")
    p.add_argument("--low", type=int, default=1)
    p.add_argument("--high", type=int, default=20)
    p.add_argument("--operations", default="+", help="e.g. '+-*'")
    p.add_argument("--few-shot", type=int, default=1)
    p.add_argument("--val-size", type=int, default=64, help="the RL job's env.config.val_size")
    a = p.parse_args(argv)
    rows = math_chats(a.n, a.seed, a.low, a.high, tuple(a.operations), a.few_shot, a.val_size)
    write_jsonl(rows, a.out)
    print(f"wrote {len(rows)} chats to {a.out}")


if __name__ == "__main__":
    main()
