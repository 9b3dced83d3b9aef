"""The tools of one episode: the calls of a turn checked against their schemas, each run within
its time, and answered as `tool` messages; every malformed or failed call is an answer the model
reads (and a count), never a crashed episode.

Counts, in the episode's info (tracking/metrics turns them into rates): `tool_calls` (every call
attempted, malformed ones too), `tool_invalid` (malformed: not JSON, an unknown tool, arguments
that fail the schema, over the turn's limit) and `tool_errors` (invalid, or the tool failed or
timed out).
"""

from __future__ import annotations

import functools
import json
import threading
import time
from typing import Any, Callable

from opentinker.core.schema_cost import PAST_TIME, ArgumentsUnchecked, SchemaRefused, bounded_validator, first_error, schema_text
from opentinker.tools.declared import Tool, ToolCall, ToolError, ToolResult
from opentinker.tools.formats import ParsedTurn

MAX_RESULT_CHARS = 4000  # what a tool message keeps of a long answer (the model reads the start)
INVALID = ("bad_call", "unknown_tool", "bad_arguments", "too_many_calls")

Bounded = Callable[..., Any]  # (fn, timeout_s, *args) -> an outcome with .value and .error (agent.guard.call_with_timeout)


def checked_tools(tools: list[Tool]) -> list[Tool]:
    """The tools, refused in one line if one is not a Tool, a name is malformed or repeated
    (`merge_tools`), or a schema is not a JSON Schema or could cost a check unbounded work
    (core.schema_cost: its size, depth, $refs and combinators)."""
    if not tools:
        return tools
    from opentinker.tools.sources import merge_tools

    for tool in tools:
        if not isinstance(tool, Tool):
            raise TypeError(f"a declared tool is {type(tool).__name__}, expected opentinker.tools.Tool")
    merge_tools([tools])
    for tool in tools:
        try:
            validator_of(tool)
        except SchemaRefused as err:
            raise ValueError(f"tool {tool.name!r}: its parameters schema {err} (refused)") from None
    return tools


def validator_of(tool: Tool) -> Any:
    """The tool's argument validator (core.schema_cost.bounded_validator), built once per schema:
    a job's tools are listed once, and a game's are the same schema every episode. SchemaRefused
    (why, naming nothing: the caller names the tool and its source) when its schema is refused."""
    return _validator(schema_text(tool.parameters))


@functools.lru_cache(maxsize=512)
def _validator(text: str) -> Any:
    return bounded_validator(json.loads(text))


class ToolBox:
    """One episode's tools. `answer(turn, bounded)` runs a parsed turn's calls in order."""

    def __init__(self, tools: list[Tool], max_calls_per_turn: int = 4, max_result_chars: int = MAX_RESULT_CHARS):
        self.tools = {t.name: t for t in checked_tools(tools)}
        self._validators = {t.name: validator_of(t) for t in tools}  # built when the tools were listed: cached
        self.max_calls_per_turn = max_calls_per_turn
        self.max_result_chars = max_result_chars
        self.counts = {"tool_calls": 0, "tool_invalid": 0, "tool_errors": 0}

    def schemas(self) -> list[dict[str, Any]]:
        return [t.schema() for t in self.tools.values()]

    def answer(self, turn: ParsedTurn, bounded: Bounded) -> list[ToolResult]:
        """A result for every call of the turn: the malformed ones first, then the others in the order written."""
        results = [ToolResult(name="", content=f"error: {line}", error="bad_call") for line in turn.errors]
        for call in turn.calls:
            if len(results) >= self.max_calls_per_turn:
                results.append(ToolResult(call.name, f"error: at most {self.max_calls_per_turn} tool calls a turn; this one was not run",
                                          "too_many_calls", call.id))
            else:
                results.append(self._one(call, bounded))
        for result in results:
            self.counts["tool_calls"] += 1
            self.counts["tool_invalid"] += result.error in INVALID
            self.counts["tool_errors"] += result.error is not None
        return results

    def _one(self, call: ToolCall, bounded: Bounded) -> ToolResult:
        tool = self.tools.get(call.name)
        if tool is None:
            known = ", ".join(self.tools) or "none"
            return ToolResult(call.name, f"error: there is no tool named {json.dumps(call.name)[:80]} (tools: {known})", "unknown_tool", call.id)
        t0 = time.perf_counter()
        deadline, checking = time.monotonic() + tool.timeout_s, threading.Event()
        checking.set()
        out = bounded(_checked_run, tool.timeout_s, tool, self._validators[tool.name], call.arguments, deadline, checking)
        seconds = time.perf_counter() - t0
        if out.error is None:
            kind, text = out.value
            return ToolResult(tool.name, self._clip(text), kind, call.id, seconds)
        kind = "timeout" if out.error.startswith("timed out") else "failed"
        if kind == "timeout" and checking.is_set():  # the time ran out in the check (which stops itself at `deadline`)
            return ToolResult(tool.name, f"error: arguments: {PAST_TIME} ({tool.timeout_s:g}s, the tool's timeout)", kind, call.id, seconds)
        message = out.error.split(": ", 1)[1] if out.error.startswith("ToolError: ") else out.error
        return ToolResult(tool.name, self._clip(f"error: {message}"), kind, call.id, seconds)

    def _clip(self, text: str) -> str:
        if len(text) <= self.max_result_chars:
            return text
        return f"{text[: self.max_result_chars]}\n… ({len(text):,} characters; the rest was cut)"


def _checked_run(tool: Tool, validator: Any, arguments: dict[str, Any], deadline: float,
                 checking: threading.Event) -> tuple[str | None, str]:
    """(the failure's kind or None, the text the model reads): the arguments checked against the
    schema, then the call, in one worker, so that both are within the tool's time; a check past
    `deadline` stops itself (its thread ends: core.schema_cost.first_error). `checking` is
    cleared as the tool is called, so a timeout says which of the two ran out of time."""
    try:
        problem = first_error(validator, arguments, deadline=deadline)
    except ArgumentsUnchecked as err:
        return err.kind, f"error: arguments: {err}" + (f" ({tool.timeout_s:g}s, the tool's timeout)" if err.kind == "timeout" else "")
    if problem is not None:
        where = "/".join(str(p) for p in problem.absolute_path) or "arguments"
        return "bad_arguments", f"error: {where}: {problem.message[:300]}"
    checking.clear()
    value = tool.run(arguments)
    if not isinstance(value, str):
        raise ToolError(f"the tool returned {type(value).__name__}, not text")
    return None, value
