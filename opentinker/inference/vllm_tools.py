"""Runs inside vLLM's API server (`--tool-parser-plugin`, in vLLM's environment): the tool parser
`opentinker`, which a served checkpoint's replies go through on vLLM. It is vLLM's `hermes` parser
held to the rules both engines keep (chat_rules.py):

- a reply has tool calls only when every `<tool_call>` block parses as training parses it
  (opentinker.tools.formats, bounded) and names a function the request declared; otherwise it is
  content, the model's text as written, and vLLM's log has one line saying why (vLLM's own parser
  returned calls of functions nobody declared);

It imports vLLM, the standard library and the two project modules that import nothing else
(opentinker.tools.formats, opentinker.inference.chat_rules).
"""

from __future__ import annotations

import json
import logging
from typing import Any

from vllm.entrypoints.generate.base.protocol import ExtractedToolCallInformation, FunctionCall, ToolCall
from vllm.tool_parsers.abstract_tool_parser import ToolParserManager
from vllm.tool_parsers.hermes_tool_parser import Hermes2ProToolParser

from opentinker.inference.chat_rules import undeclared
from opentinker.tools.formats import CALL_OPEN, ParsedTurn, ToolFormat

log = logging.getLogger("vllm.opentinker.tool_calls")  # under vLLM's logger, whose handler writes the server's log
_FORMATS: dict[int, ToolFormat] = {}  # one per tokenizer (the server has one): its construction renders a template


def _hermes(tokenizer: Any) -> ToolFormat:
    if id(tokenizer) not in _FORMATS:
        _FORMATS[id(tokenizer)] = ToolFormat(tokenizer, "hermes")
    return _FORMATS[id(tokenizer)]


@ToolParserManager.register_module("opentinker")
class ServedToolCalls(Hermes2ProToolParser):
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
