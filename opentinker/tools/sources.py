"""Where a job's tools come from, put together: a game's own (`AbstractGame.get_tools`), MCP
servers' (opentinker.tools.mcp), any other list. One name, one tool: a name declared twice is
an error, never a silent choice."""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

from opentinker.env.base import ToolFailure
from opentinker.tools.declared import NAME_PATTERN, Tool, ToolError


def as_tool(item: Any) -> Tool:
    """A Tool as is; anything else with its fields (a GameTool of the layers below) as a Tool whose
    `run` turns ToolFailure into ToolError (names are checked by `merge_tools`)."""
    if isinstance(item, Tool):
        return item
    inner = item.run

    def run(arguments: dict[str, Any]) -> str:
        try:
            return inner(arguments)
        except ToolFailure as err:
            raise ToolError(str(err)) from None

    return Tool(item.name, item.description, run, item.parameters, item.timeout_s)


def as_tools(items: Iterable[Any]) -> list[Tool]:
    """`as_tool` of each (what `AbstractGame.get_tools` returned), names unique."""
    return merge_tools([[as_tool(item) for item in items]])


def merge_tools(lists: Iterable[Iterable[Tool]], sources: Iterable[str] | None = None) -> list[Tool]:
    """The tools of several sources (a job's spec, MCP servers, a game), in order; ValueError in one
    line for a malformed name, or naming a repeated tool and, given `sources` (one name per list,
    e.g. the MCP URLs), the two that declare it. The one check of tool names."""
    names = list(sources) if sources is not None else None
    out: list[Tool] = []
    owner: dict[str, int] = {}
    for index, tools in enumerate(lists):
        for tool in tools:
            if not re.match(NAME_PATTERN, str(tool.name)):
                raise ValueError(f"the tool name {str(tool.name)[:80]!r} does not match {NAME_PATTERN}")
            if tool.name in owner:
                first = owner[tool.name]
                where = (f" by {names[first]} and by {names[index]}" if first != index else f" twice by {names[index]}") \
                    if names is not None and index < len(names) else ""
                raise ValueError(f"the tool {tool.name!r} is declared{where or ' twice'}: each tool name must be unique in a job")
            owner[tool.name] = index
            out.append(tool)
    return out
