"""A hosted game's tools over the wire: what a host (an environment server, the user's client
behind the link) sends of `get_tools()` and how it answers a call, and what the job side accepts
of the list (the host is the tenant's: anything it sends is checked).

The list goes with reset's answer (`"tools"`): each tool as its OpenAI function schema plus its
`timeout_s`. A call's answer is `{"content": text}`, or `{"error": message}` for a call that
failed: the tool's own message for a ToolError (opentinker.tools) or ToolFailure, which the model
reads; `the tool failed: <ExcType>` for anything else (no traceback leaves the host); `timed out
after Ns` past the tool's timeout (its thread is abandoned, as the job's own guard does).

This layer may not import opentinker.tools: a ToolError is known by its class name.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable
from typing import Any

from opentinker.core.schema_cost import SchemaRefused, check_cost
from opentinker.env.base import GameTool, ToolFailure
from opentinker.env.hosting import plain_json

NAME_RULE = r"^[A-Za-z_][A-Za-z0-9_.-]{0,63}$"  # opentinker.tools.declared.NAME_PATTERN
MAX_TOOLS = 64
MAX_DESCRIPTION_CHARS = 2000
MAX_ERROR_CHARS = 2000
TOOL_MARGIN_S = 1.0  # the job waits this much past a tool's timeout, so the host's own answer arrives first
_READABLE = ("ToolError", "ToolFailure")


# --- the host's side ----------------------------------------------------------------------------
def tool_listing(tools: list[Any]) -> list[dict[str, Any]]:
    """What the job is sent of an episode's tools (Tools or GameTools)."""
    return [plain_json({"type": "function", "function": {"name": t.name, "description": t.description, "parameters": t.parameters},
                        "timeout_s": float(t.timeout_s)}) for t in tools]


def tools_by_name(tools: list[Any]) -> dict[str, Any]:
    return {str(t.name): t for t in tools}


def call_reply(tool: Any, arguments: Any) -> dict[str, Any]:
    """Run one call of `tool` within its timeout: `{"content"}` or `{"error"}` (see the module docstring)."""
    if not isinstance(arguments, dict):
        return {"error": f"the arguments are {type(arguments).__name__}, not an object"}
    timeout_s = min(max(float(tool.timeout_s), 0.001), 3600.0)
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["value"] = tool.run(arguments)
        except BaseException as err:  # noqa: BLE001 - any failure of the tool is its call's answer
            out["error"] = err

    thread = threading.Thread(target=run, name=f"tool-{tool.name}", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        return {"error": f"timed out after {timeout_s:g}s"}
    if "error" in out:
        err = out["error"]
        if any(c.__name__ in _READABLE for c in type(err).__mro__):
            return {"error": str(err)[:MAX_ERROR_CHARS]}
        return {"error": f"the tool failed: {type(err).__name__}"}
    if not isinstance(out.get("value"), str):
        return {"error": f"the tool returned {type(out.get('value')).__name__}, not text"}
    return {"content": out["value"]}


# --- the job's side -----------------------------------------------------------------------------
def call_answer(answer: Any) -> str:
    """A call's text from the host's answer; ToolFailure for its error (or an answer that is neither)."""
    if isinstance(answer, dict) and isinstance(answer.get("content"), str):
        return answer["content"]
    if isinstance(answer, dict) and "error" in answer:
        raise ToolFailure(str(answer["error"])[:MAX_ERROR_CHARS] or "the tool failed")
    raise ToolFailure("the environment's answer to the call has no text")


def _checked(item: Any, index: int, seen: set[str]) -> tuple[str, str, dict[str, Any], Any]:
    if not isinstance(item, dict) or not isinstance(item.get("function"), dict):
        raise ValueError(f"tool {index} is not a function schema")
    function = item["function"]
    name = function.get("name")
    if not isinstance(name, str) or not re.match(NAME_RULE, name):
        raise ValueError(f"tool {index}: the name {str(name)[:80]!r} does not match {NAME_RULE}")
    if name in seen:
        raise ValueError(f"the tool {name!r} is declared twice")
    seen.add(name)
    description = function.get("description", "")
    if not isinstance(description, str):
        raise ValueError(f"tool {name!r}: the description is {type(description).__name__}, not text")
    parameters = function.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(parameters, dict):
        raise ValueError(f"tool {name!r}: the parameters are {type(parameters).__name__}, not a JSON Schema object")
    try:
        check_cost(parameters)  # size, depth, $refs, combinators: what checking a call against it may cost
    except SchemaRefused as err:
        raise ValueError(f"tool {name!r}: its parameters schema {err} (refused)") from None
    return name, description[:MAX_DESCRIPTION_CHARS], parameters, item.get("timeout_s")


def tools_from_listing(listing: Any, call: Callable[[str, dict[str, Any], float], Any], max_timeout_s: float) -> list[GameTool]:
    """GameTools of a host's list; `call(name, arguments, timeout_s)` returns the host's answer to one
    call (or raises ToolFailure). Each call waits for the tool's own timeout, at most `max_timeout_s`
    (the job's per-request timeout), plus a margin. ValueError saying what is wrong with a list that
    is not one: too long, a bad name, parameters that are not an object or could cost a check
    unbounded work (opentinker.core.schema_cost)."""
    if listing is None:
        return []
    if not isinstance(listing, list):
        raise ValueError(f"the tool list is {type(listing).__name__}, not a list")
    if len(listing) > MAX_TOOLS:
        raise ValueError(f"{len(listing):,} tools, over the {MAX_TOOLS} an episode may have")
    seen: set[str] = set()
    tools = []
    for index, item in enumerate(listing):
        name, description, parameters, declared = _checked(item, index, seen)
        timeout_s = max_timeout_s
        if isinstance(declared, (int, float)) and not isinstance(declared, bool) and 0 < declared < max_timeout_s:
            timeout_s = float(declared)
        tools.append(GameTool(name, description, _runner(call, name, timeout_s + TOOL_MARGIN_S), parameters, timeout_s + TOOL_MARGIN_S))
    return tools


def _runner(call: Callable[[str, dict[str, Any], float], Any], name: str, timeout_s: float) -> Callable[[dict[str, Any]], str]:
    def run(arguments: dict[str, Any]) -> str:
        return call_answer(call(name, arguments, timeout_s))

    return run
