"""SFT data: JSONL chats checked line by line (every bad line named before a model loads), and
the seeded train/held-out split."""

from __future__ import annotations

import json
import random
from typing import Any

from opentinker.sft.spec import SFTDataError

ROLES = ("system", "user", "assistant")


def chat_problem(row: Any) -> str | None:
    """Why a parsed line is not a chat we can train on, or None."""
    if not isinstance(row, dict) or not isinstance(row.get("messages"), list):
        return 'expected an object with a "messages" list'
    messages = row["messages"]
    if not messages:
        return "messages: empty"
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            return f"messages[{i}]: expected an object with role and content"
        extra = sorted(set(m) - {"role", "content"})
        if extra:
            return f"messages[{i}]: unknown key {extra[0]!r} (only role and content)"
        if m.get("role") not in ROLES:
            return f"messages[{i}].role: must be one of {', '.join(ROLES)} (got {m.get('role')!r})"
        if not isinstance(m.get("content"), str):
            return f"messages[{i}].content: must be a string"
        if m["role"] == "system" and i != 0:
            return f"messages[{i}]: a system message may only come first"
    if not any(m["role"] == "assistant" for m in messages):
        return "no assistant message: nothing to train on"
    return None


def load_chats(url: str, max_errors: int = 10) -> list[tuple[int, list[dict[str, str]]]]:
    """(line number, messages) of every chat in a JSONL file; SFTDataError names each bad line."""
    import fsspec

    try:
        with fsspec.open(url, "rt", encoding="utf-8") as f:
            lines = f.read().splitlines()
    except FileNotFoundError:
        raise SFTDataError(f"data.path: {url} does not exist") from None
    except UnicodeDecodeError as err:
        raise SFTDataError(f"data.path: {url} is not UTF-8 text ({err.reason} at byte {err.start})") from None
    chats, errors = [], []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            problem = f"not valid JSON ({err.msg}, column {err.colno})"
        else:
            problem = chat_problem(row)
        if problem:
            errors.append(f"data.path: line {number}: {problem}")
        else:
            chats.append((number, row["messages"]))
    if errors:
        more = f"\n… and {len(errors) - max_errors} more bad lines" if len(errors) > max_errors else ""
        raise SFTDataError("\n".join(errors[:max_errors]) + more)
    if not chats:
        raise SFTDataError(f"data.path: {url} holds no examples")
    return chats


def split_chats(chats: list, eval_fraction: float, seed: int) -> tuple[list, list]:
    """(train, eval): a seeded shuffle; at least one of each when eval_fraction > 0."""
    order = list(range(len(chats)))
    random.Random(seed).shuffle(order)
    n_eval = max(1, round(len(chats) * eval_fraction)) if eval_fraction > 0 else 0
    if n_eval >= len(chats):
        raise SFTDataError(f"data.eval_fraction: {eval_fraction} of {len(chats)} examples leaves none to train on")
    return [chats[i] for i in order[n_eval:]], [chats[i] for i in order[:n_eval]]



