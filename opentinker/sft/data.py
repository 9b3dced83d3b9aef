"""SFT data: JSONL chats checked line by line (every bad line named before a model loads), and
the seeded train/held-out split."""

from __future__ import annotations

import json
import random
from typing import Any

from opentinker.sft.spec import SFTDataError

ROLES = ("system", "user", "assistant", "tool")
KEYS = {"role", "content", "tool_calls", "name", "tool_call_id"}


def _call_problem(call: Any) -> str | None:
    f = call.get("function", call) if isinstance(call, dict) else None
    if not isinstance(f, dict) or not isinstance(f.get("name"), str) or not isinstance(f.get("arguments"), (dict, str)):
        return 'expected {"function": {"name": "...", "arguments": {...}}}'
    return None


def chat_problem(row: Any) -> str | None:
    """Why a parsed line is not a chat we can train on, or None. A chat may carry `tools` (OpenAI
    function schemas), assistant `tool_calls` and `tool` messages: it trains in the hermes format."""
    if not isinstance(row, dict) or not isinstance(row.get("messages"), list):
        return 'expected an object with a "messages" list'
    if sorted(set(row) - {"messages", "tools"}):
        return f"unknown key {sorted(set(row) - {'messages', 'tools'})[0]!r} (only messages and tools)"
    tools = row.get("tools", [])
    if not isinstance(tools, list) or not all(isinstance(t, dict) and isinstance(t.get("function", {}).get("name"), str) for t in tools):
        return 'tools: expected a list of {"type": "function", "function": {"name": ..., "parameters": ...}}'
    messages = row["messages"]
    if not messages:
        return "messages: empty"
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            return f"messages[{i}]: expected an object with role and content"
        extra = sorted(set(m) - KEYS)
        if extra:
            return f"messages[{i}]: unknown key {extra[0]!r} (only {', '.join(sorted(KEYS))})"
        if m.get("role") not in ROLES:
            return f"messages[{i}].role: must be one of {', '.join(ROLES)} (got {m.get('role')!r})"
        if not isinstance(m.get("content"), str) and not (m.get("tool_calls") and m.get("content") is None):
            return f"messages[{i}].content: must be a string"
        if m["role"] == "system" and i != 0:
            return f"messages[{i}]: a system message may only come first"
        if "tool_calls" in m and (m["role"] != "assistant" or not isinstance(m["tool_calls"], list)):
            return f"messages[{i}].tool_calls: a list, on an assistant message only"
        for j, call in enumerate(m.get("tool_calls") or []):
            if problem := _call_problem(call):
                return f"messages[{i}].tool_calls[{j}]: {problem}"
    if not any(m["role"] == "assistant" for m in messages):
        return "no assistant message: nothing to train on"
    return None


def plain_chat(row: dict[str, Any]) -> list[dict[str, str]]:
    """The chat as system/user/assistant text: tools, calls and results written in the hermes
    format (what RL renders for a model whose template has no tool format of its own)."""
    from opentinker.tools.formats import hermes_messages

    messages = row["messages"]
    if row.get("tools") or any(m["role"] == "tool" or m.get("tool_calls") for m in messages):
        return hermes_messages(messages, row.get("tools"))
    return messages


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
            chats.append((number, plain_chat(row)))
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



