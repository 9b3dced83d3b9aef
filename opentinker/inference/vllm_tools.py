"""Runs inside vLLM's API server (`--tool-parser-plugin`, in vLLM's environment): the tool parser
`opentinker`, which a served checkpoint's replies go through on vLLM. It is vLLM's `hermes` parser
held to the rules both engines keep (chat_rules.py):

- a reply has tool calls only when every `<tool_call>` block parses as training parses it
  (opentinker.tools.formats, bounded) and names a function the request declared; otherwise it is
  content, the model's text as written, and vLLM's log has one line saying why (vLLM's own parser
  returned calls of functions nobody declared);
- streamed, the text before the first call goes out as it comes, and from the first `<tool_call>`
  on the reply waits for the end of generation: then its calls, each whole in one delta, or its
  text (vLLM's parser streamed an unclosed call's first pieces as a call, or nothing);
- where vLLM constrains a call (`tool_choice` "required" or naming a function,
  `parallel_tool_calls: false`), the arguments are held to the function's schema too, as
  `--tool-strict-level parameter` would hold them: vLLM's default constrains such a call's name
  but leaves its arguments any JSON (`null`, `"/"`, `[0]` came back). `tool_choice: auto` is left
  unconstrained: the policy samples as it was trained.

It imports vLLM (with its pydantic and xgrammar), the standard library and the two project modules that import nothing else
(opentinker.tools.formats, opentinker.inference.chat_rules).
"""

from __future__ import annotations

import json
import logging
from typing import Any

from pydantic import BaseModel
from vllm.entrypoints.generate.base.protocol import (DeltaFunctionCall, DeltaMessage, DeltaToolCall, ExtractedToolCallInformation,
                                                     FunctionCall, ToolCall)
from vllm.renderers.chat_utils import make_tool_call_id
from vllm.tool_parsers.abstract_tool_parser import ToolParserManager
from vllm.tool_parsers.hermes_tool_parser import Hermes2ProToolParser
from vllm.tool_parsers.tool_strict_level import ToolStrictLevel
from vllm.tool_parsers.utils import partial_tag_overlap
from xgrammar.structural_tag import JSONSchemaFormat

from opentinker.inference.chat_rules import undeclared
from opentinker.tools.formats import CALL_OPEN, ParsedTurn, ToolFormat

log = logging.getLogger("vllm.opentinker.tool_calls")  # under vLLM's logger, whose handler writes the server's log
# consecutive whitespace characters in constrained arguments: one, as training writes a call's JSON (json.dumps, ", " and ": ");
# unbounded, the tiny model's arguments were whitespace until its budget ran out
MAX_WHITESPACE = 1
_FORMATS: dict[int, ToolFormat] = {}  # one per tokenizer (the server has one): its construction renders a template


def _hermes(tokenizer: Any) -> ToolFormat:
    if id(tokenizer) not in _FORMATS:
        _FORMATS[id(tokenizer)] = ToolFormat(tokenizer, "hermes")
    return _FORMATS[id(tokenizer)]


def _bound_whitespace(node: Any) -> None:
    """Every JSON schema format in a structural tag: at most MAX_WHITESPACE whitespace characters in a row."""
    if isinstance(node, JSONSchemaFormat) and node.max_whitespace_cnt is None:
        node.max_whitespace_cnt = MAX_WHITESPACE
    if isinstance(node, BaseModel):
        for name in type(node).model_fields:
            _bound_whitespace(getattr(node, name))
    elif isinstance(node, (list, tuple)):
        for item in node:
            _bound_whitespace(item)


@ToolParserManager.register_module("opentinker")
class ServedToolCalls(Hermes2ProToolParser):
    # vLLM hands this parser each delta alone and asks `finish_streaming` at the end of generation
    engine_based_streaming = True

    def __init__(self, tokenizer: Any, tools: Any = None):
        super().__init__(tokenizer, tools)
        self._text, self._sent, self._request = "", 0, None  # a stream's reply so far, how much went out as content

    def get_structural_tag(self, request: Any, *, reasoning: bool = False, strict_level: ToolStrictLevel = ToolStrictLevel.AUTO):
        """Asked only where vLLM constrains the call's envelope: its arguments too, to their schema
        and with runs of whitespace bounded (xgrammar allows any: the tiny model's constrained
        arguments were whitespace until the budget ran out, and never closed)."""
        tag = super().get_structural_tag(request, reasoning=reasoning, strict_level=max(strict_level, ToolStrictLevel.PARAMETER))
        if tag is not None:
            _bound_whitespace(tag.format)
        return tag

    def _turn(self, text: str, request: Any) -> ParsedTurn | None:
        """The reply's calls, or None where it is content (logged when it held calls that are not returned)."""
        if request.tool_choice == "none" or CALL_OPEN not in text:
            return None
        turn = _hermes(self.model_tokenizer).parse(text)
        declared = {t.function.name for t in request.tools or [] if getattr(t, "function", None) is not None}
        why = "; ".join(turn.errors) if turn.errors else undeclared([c.name for c in turn.calls], declared)
        if why or not turn.calls:
            log.warning("a reply's tool calls were not returned as calls: %s", (why or "none parsed")[:500])
            return None
        return turn

    def extract_tool_calls(self, model_output: str, request: Any) -> ExtractedToolCallInformation:
        turn = self._turn(model_output, request)
        if turn is None:
            return ExtractedToolCallInformation(tools_called=False, tool_calls=[], content=model_output)
        calls = [ToolCall(function=FunctionCall(name=c.name, arguments=json.dumps(c.arguments, ensure_ascii=False))) for c in turn.calls]
        return ExtractedToolCallInformation(tools_called=True, tool_calls=calls, content=turn.content or None)

    def extract_tool_calls_streaming(self, previous_text: str, current_text: str, delta_text: str, previous_token_ids: Any,
                                     current_token_ids: Any, delta_token_ids: Any, request: Any) -> DeltaMessage | None:
        self._text += delta_text
        self._request = request
        start = self._text.find(CALL_OPEN)
        if request.tool_choice == "none":
            return self._content(len(self._text))
        if start == -1:  # a tag's first characters wait for the next delta
            return self._content(len(self._text) - partial_tag_overlap(self._text, CALL_OPEN))
        return self._content(start)

    def _content(self, upto: int, final: bool = False) -> DeltaMessage | None:
        """The text up to `upto` not sent yet; trailing whitespace waits (a call after it drops it, as parsing strips it)."""
        piece = self._text[self._sent:upto]
        piece = piece if final else piece.rstrip()
        if not piece:
            return None
        self._sent += len(piece)
        return DeltaMessage(content=piece)

    def finish_streaming(self) -> DeltaMessage | None:
        turn = self._turn(self._text, self._request) if self._request is not None else None
        if turn is None:
            return self._content(len(self._text), final=True)  # the reply is text: what was held goes out as it is
        self._sent = len(self._text)
        return DeltaMessage(tool_calls=[
            DeltaToolCall(index=k, id=make_tool_call_id(), type="function",
                          function=DeltaFunctionCall(name=c.name, arguments=json.dumps(c.arguments, ensure_ascii=False)))
            for k, c in enumerate(turn.calls)])
