"""Tool calls on the HF server: OpenAI's `tools=` in, `tool_calls` out, in the format the policy
was trained in (opentinker.tools.formats: its template's own where it renders tools, else the
hermes default), as vLLM's server answers them with its `hermes` parser.

A request's tools are read as vLLM reads them (a function's name, description and parameters,
`strict` when given), and an assistant message's call arguments as objects, so both engines render
one request to the same prompt. `tool_choice` is "auto" (the default) or "none" (the tools are in
the prompt, the reply is not parsed); a required or named call is refused: nothing here forces a
model to call; `parallel_tool_calls: false` returns a reply's first call only (as vLLM does). A
reply has `tool_calls` when every one of its `<tool_call>` blocks parses and names a declared
function (chat_rules.py): the text before the first call is `content` (or null) and
`finish_reason` is "tool_calls". Otherwise (a malformed or unclosed call, a call of anything the
request did not declare) the whole reply is content, and the server logs one line saying why.
"""

from __future__ import annotations

import json
import logging
import secrets
from dataclasses import dataclass, field
from typing import Any

from opentinker.inference.chat_rules import BadChatRequest, call_arguments, declared_names, shown, undeclared
from opentinker.tools.formats import ToolFormat

log = logging.getLogger(__name__)


@dataclass
class ToolRequest:
    tools: list[dict[str, Any]] | None  # as the template takes them
    parse: bool  # whether the reply's calls are read (tool_choice "auto" with tools)
    single: bool = False  # parallel_tool_calls: false, a reply's first call only
    names: set[str] = field(default_factory=set)  # the functions declared: the only calls a reply returns


def read_tools(extra: dict[str, Any]) -> ToolRequest:
    """The request's `tools`, `tool_choice` and `parallel_tool_calls` (fields the request model keeps as extras)."""
    tools, choice, parallel = extra.get("tools"), extra.get("tool_choice"), extra.get("parallel_tool_calls")
    if choice not in (None, "auto", "none"):
        raise BadChatRequest(f"tool_choice {shown(choice)} is not supported by this server: use 'auto' or 'none'", "tool_choice")
    if parallel is not None and not isinstance(parallel, bool):
        raise BadChatRequest("parallel_tool_calls: must be true or false", "parallel_tool_calls")
    if tools is None:
        return ToolRequest(None, False)
    if not isinstance(tools, list) or not tools:
        raise BadChatRequest("tools: must be a non-empty list of function schemas", "tools")
    functions = [_function(t, i) for i, t in enumerate(tools)]
    return ToolRequest(functions, choice != "none", parallel is False, declared_names(functions))


def _function(tool: Any, index: int) -> dict[str, Any]:
    function = tool.get("function") if isinstance(tool, dict) and tool.get("type", "function") == "function" else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
        raise BadChatRequest(f'tools[{index}]: must be {{"type": "function", "function": {{"name": ..., "parameters": {{...}}}}}}', "tools")
    if function.get("parameters") is not None and not isinstance(function["parameters"], dict):
        raise BadChatRequest(f"tools[{index}].function.parameters: must be a JSON Schema object", "tools")
    out = {"name": function["name"], "description": function.get("description"), "parameters": function.get("parameters")}
    if function.get("strict") is not None:
        out["strict"] = function["strict"]
    return {"type": "function", "function": out}


def message_fields(index: int, role: str, extra: dict[str, Any]) -> dict[str, Any]:
    """What chat message `index` carries besides its role and content: an assistant's `tool_calls`
    (arguments as objects; the history is checked already, chat_rules.check_messages), a tool
    result's `tool_call_id` and `name`."""
    if role == "tool":
        return {k: extra[k] for k in ("tool_call_id", "name") if extra.get(k) is not None}
    calls = extra.get("tool_calls") if role == "assistant" else None
    if not calls:
        return {}
    return {"tool_calls": [{**call, "type": "function", "function": {**call["function"],
                                                                     "arguments": call_arguments(call, f"messages[{index}].tool_calls[{j}]")}}
                           for j, call in enumerate(calls)]}


def uses_tools(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> bool:
    """Whether the prompt is rendered with the tool format (tools, calls or results in it)."""
    return bool(tools) or any(m["role"] == "tool" or m.get("tool_calls") for m in messages)


def render(tools_format: ToolFormat, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> str:
    """The prompt, ending with the assistant's generation prompt, as training renders it."""
    if any(not isinstance(m.get("content"), (str, type(None))) for m in messages):
        raise BadChatRequest("messages: images are not taken together with tools, tool calls or tool results", "messages")
    return tools_format.render([m | {"content": m.get("content") or ""} for m in messages], tools, add_generation_prompt=True)


def reply(tools_format: ToolFormat, text: str, reason: str, tooling: ToolRequest) -> tuple[dict[str, Any], str]:
    """(the assistant message, finish_reason) of one completion: its calls where every one parses
    and is declared, else its text (and a log line saying why)."""
    turn = tools_format.parse(text)
    if not turn.attempted:
        return {"role": "assistant", "content": text}, reason
    why = "; ".join(turn.errors) if turn.errors else undeclared([c.name for c in turn.calls], tooling.names)
    if why:
        log.warning("a reply's tool calls were not returned as calls: %s", why[:500])
        return {"role": "assistant", "content": text}, reason
    calls = [{"id": f"call_{secrets.token_hex(12)}", "type": "function",
              "function": {"name": c.name, "arguments": json.dumps(c.arguments, ensure_ascii=False)}}
             for c in (turn.calls[:1] if tooling.single else turn.calls)]
    return {"role": "assistant", "content": turn.content or None, "tool_calls": calls}, "tool_calls"


def stream_deltas(message: dict[str, Any]) -> list[dict[str, Any]]:
    """A parsed reply as streamed deltas: its text, then every call whole (index, id, name, arguments)."""
    deltas = [{"content": message["content"]}] if message.get("content") else []
    return deltas + [{"tool_calls": [{"index": k} | call]} for k, call in enumerate(message["tool_calls"])]
