"""A declared tool: its OpenAI function schema and the code that answers a call.

Whatever a tool is (a game's own function, an MCP server's tool, the sandbox's `python`), the
agent loop sees this one shape: `schema()` goes to the chat template (`tools=`), `call(arguments)`
returns the text the model reads next. A tool signals a failure the model should read (bad input,
a refused lookup) by raising ToolError; anything else it raises is reported to the model as an
error too, and counted, never fatal to the episode.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

NAME_PATTERN = r"^[A-Za-z_][A-Za-z0-9_.-]{0,63}$"


class ToolError(Exception):
    """A failed call whose message the model reads as the tool's answer."""


@dataclass
class Tool:
    """One callable function. `parameters` is a JSON Schema object (OpenAI's `function.parameters`);
    `run(arguments)` gets the validated arguments and returns text; `timeout_s` bounds one call."""

    name: str
    description: str
    run: Callable[[dict[str, Any]], str]
    parameters: dict[str, Any] = field(default_factory=lambda: {"type": "object", "properties": {}})
    timeout_s: float = 30.0

    def schema(self) -> dict[str, Any]:
        """The OpenAI function schema, as chat templates and the openai SDK take it."""
        return {"type": "function", "function": {"name": self.name, "description": self.description, "parameters": self.parameters}}


@dataclass
class ToolCall:
    """One call the model wrote: the tool's name and its arguments (a JSON object)."""

    name: str
    arguments: dict[str, Any]
    id: str = ""


@dataclass
class ToolResult:
    """What a call returned (or why it failed), shown to the model as a `tool` message."""

    name: str
    content: str
    error: str | None = None  # the kind of failure, counted in metrics: unknown_tool, bad_arguments, failed, timeout, ...
    call_id: str = ""
    seconds: float = 0.0
