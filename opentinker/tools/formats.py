"""How a policy writes tools and calls: its own chat template where it renders `tools=`, and
otherwise one documented default, the hermes format (Qwen2.5's, NousResearch's Hermes):

    system:    … # Tools … <tools>{function schema as JSON}…</tools> … how to call …
    assistant: <tool_call>
               {"name": "python", "arguments": {"code": "print(17 * 23)"}}
               </tool_call>
    user:      <tool_response>
               391
               </tool_response>

The default is itself a chat template: a short Jinja prelude placed before the model's own
template that writes the tools into the system message, an assistant message's `tool_calls` as
`<tool_call>` blocks and `tool` messages as `<tool_response>` user turns. Training renders with it,
and `opentinker serve` hands the same text to vLLM (`--chat-template`, with its `hermes` tool
parser), so a served checkpoint reads and writes tools exactly as it was trained to.

Calls are parsed with the tokenizer's response parser where it has one (`response_template`),
otherwise as hermes `<tool_call>` blocks (vLLM's hermes parser reads the same). The text is the
model's, so reading it is bounded: MAX_CALLS calls a turn, JSON by `core.json_text.loads_bounded`,
and a response parser (third-party code, superlinear on some text) gets at most MAX_PARSED_CHARS,
fed as a stream, with whitespace runs cut to MAX_SPACE_RUN. Whatever the text is, it becomes calls
and error lines, never an exception.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from opentinker.core.json_text import JsonTextError, loads_bounded
from opentinker.tools.declared import ToolCall

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
MAX_CALLS = 32  # call blocks read in one turn; the rest are one error line (the toolbox runs far fewer)
MAX_PARSED_CHARS = 1 << 18  # a turn a response parser reads (64k tokens or so); a longer one is an error line
PARSER_CHUNK = 1024  # characters fed to a response parser at a time
MAX_SPACE_RUN = 64  # whitespace a response parser reads in one run
_LONG_SPACE = re.compile(r"\s{%d,}" % (MAX_SPACE_RUN + 1))
_CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)

TOOLS_INTRO = ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
               "You are provided with function signatures within <tools></tools> XML tags:\n<tools>")
TOOLS_HOW = ("\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
             "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call>")

# Rewrites `messages` before the model's own template reads them (Jinja: top-level `set` is seen
# by the rest of the template). Kept in one place so training and serving render the same text.
HERMES_PRELUDE = (
    "{%- set _ot = namespace(out=[], pending='', tools='') -%}\n"
    "{%- if tools -%}{%- for tool in tools -%}{%- set _ot.tools = _ot.tools ~ '\\n' ~ (tool | tojson) -%}{%- endfor -%}"
    "{%- set _ot.tools = " + json.dumps(TOOLS_INTRO) + " ~ _ot.tools ~ " + json.dumps(TOOLS_HOW) + " -%}{%- endif -%}\n"
    "{%- for m in messages -%}"
    "{%- if m.role == 'tool' -%}"
    "{%- set _ot.pending = _ot.pending ~ ('\\n' if _ot.pending else '') ~ '<tool_response>\\n' ~ m.content ~ '\\n</tool_response>' -%}"
    "{%- else -%}"
    "{%- if _ot.pending -%}{%- set _ot.out = _ot.out + [{'role': 'user', 'content': _ot.pending}] -%}{%- set _ot.pending = '' -%}{%- endif -%}"
    "{%- if m.role == 'assistant' and m.tool_calls -%}"
    "{%- set _call = namespace(text=(m.content or '')) -%}"
    "{%- for c in m.tool_calls -%}{%- set f = c.function if c.function is defined else c -%}"
    "{%- set _call.text = _call.text ~ ('\\n' if _call.text else '') ~ '<tool_call>\\n{\"name\": ' ~ (f.name | tojson) ~ "
    "', \"arguments\": ' ~ (f.arguments if f.arguments is string else (f.arguments | tojson)) ~ '}\\n</tool_call>' -%}"
    "{%- endfor -%}"
    "{%- set _ot.out = _ot.out + [{'role': 'assistant', 'content': _call.text}] -%}"
    "{%- elif m.role == 'system' and _ot.tools and not _ot.out -%}"
    "{%- set _ot.out = _ot.out + [{'role': 'system', 'content': m.content ~ '\\n\\n' ~ _ot.tools}] -%}"
    "{%- else -%}{%- set _ot.out = _ot.out + [m] -%}{%- endif -%}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if _ot.pending -%}{%- set _ot.out = _ot.out + [{'role': 'user', 'content': _ot.pending}] -%}{%- endif -%}"
    "{%- if _ot.tools and not (_ot.out and _ot.out[0].role == 'system') -%}"
    "{%- set _ot.out = [{'role': 'system', 'content': _ot.tools}] + _ot.out -%}{%- endif -%}"
    "{%- set messages = _ot.out -%}\n"
)

_PROBE_TOOL = {"type": "function", "function": {"name": "opentinker_probe_tool", "description": "probe",
                                                 "parameters": {"type": "object", "properties": {}}}}


def template_renders_tools(tokenizer: Any, template: str | None = None) -> bool:
    """Whether a chat template writes the tools it is given (Qwen's, Llama 3.1's do; SmolLM2's ignores them)."""
    messages = [{"role": "user", "content": "x"}]
    try:
        text = tokenizer.apply_chat_template(messages, tools=[_PROBE_TOOL], chat_template=template, tokenize=False,
                                             add_generation_prompt=True)
    except Exception:  # noqa: BLE001 - a template that fails on tools= does not render them
        return False
    return "opentinker_probe_tool" in text


def hermes_template(model_template: str) -> str:
    """The default format: the hermes prelude before the model's own template."""
    return HERMES_PRELUDE + model_template


def _tojson(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)  # as transformers' chat templates' `tojson` writes it


def hermes_messages(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> list[dict[str, str]]:
    """What the hermes prelude does to a conversation, in Python: plain system/user/assistant
    messages whose rendering by the model's own template is the hermes rendering (SFT data with
    tools trains on exactly the text RL samples in; tests check the two agree)."""
    tools_text = (TOOLS_INTRO + "".join("\n" + _tojson(t) for t in tools) + TOOLS_HOW) if tools else ""
    out: list[dict[str, str]] = []
    pending = ""
    for m in messages:
        if m["role"] == "tool":
            pending += ("\n" if pending else "") + "<tool_response>\n" + m["content"] + "\n</tool_response>"
            continue
        if pending:
            out.append({"role": "user", "content": pending})
            pending = ""
        if m["role"] == "assistant" and m.get("tool_calls"):
            text = m.get("content") or ""
            for call in m["tool_calls"]:
                f = call.get("function", call)
                arguments = f["arguments"] if isinstance(f["arguments"], str) else _tojson(f["arguments"])
                text += ("\n" if text else "") + '<tool_call>\n{"name": ' + _tojson(f["name"]) + ', "arguments": ' + arguments + "}\n</tool_call>"
            out.append({"role": "assistant", "content": text})
        elif m["role"] == "system" and tools_text and not out:
            out.append({"role": "system", "content": m["content"] + "\n\n" + tools_text})
        else:
            out.append({"role": m["role"], "content": m["content"]})
    if pending:
        out.append({"role": "user", "content": pending})
    if tools_text and not (out and out[0]["role"] == "system"):
        out.insert(0, {"role": "system", "content": tools_text})
    return out


@dataclass
class ParsedTurn:
    """What one assistant turn asked for: the calls that parsed, and one line per call that did not."""

    calls: list[ToolCall] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    content: str = ""

    @property
    def attempted(self) -> bool:
        return bool(self.calls or self.errors)


class ToolFormat:
    """The rendering and the parsing of one tokenizer's tool calls (`format`: "auto" takes the
    template's own where it renders tools, else "hermes"; "template" insists on the template's)."""

    def __init__(self, tokenizer: Any, format: str = "auto"):
        if format not in ("auto", "template", "hermes"):
            raise ValueError(f"tool format {format!r}: auto, template or hermes")
        self.tokenizer = tokenizer
        own = template_renders_tools(tokenizer)
        if format == "template" and not own:
            raise ValueError("the policy's chat template does not render tools= (format 'template'); use 'auto' or 'hermes'")
        self.name = "template" if own and format != "hermes" else "hermes"
        self.chat_template: str | None = None if self.name == "template" else hermes_template(_model_template(tokenizer))
        self.response_template = getattr(tokenizer, "response_template", None) if self.name == "template" else None

    def render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, add_generation_prompt: bool) -> str:
        """The conversation as the policy reads it, tools and all."""
        return self.tokenizer.apply_chat_template(messages, tools=tools or None, chat_template=self.chat_template,
                                                  tokenize=False, add_generation_prompt=add_generation_prompt)

    def parse(self, text: str, prefix: str = "") -> ParsedTurn:
        """The calls in one assistant turn; a malformed one becomes an error line, never an exception."""
        if self.response_template is not None:
            return self._parse_with_template(text, prefix)
        turn = ParsedTurn(content=text.split(CALL_OPEN, 1)[0].strip())
        for i, match in enumerate(_CALL.finditer(text)):
            if i == MAX_CALLS:
                turn.errors.append(f"more than {MAX_CALLS} tool calls in one turn: the rest were not read")
                break
            _add_call(turn, _unclosed(match.group(1).strip()), i)
        return turn

    def _parse_with_template(self, text: str, prefix: str) -> ParsedTurn:
        if len(text) > MAX_PARSED_CHARS:
            return ParsedTurn(errors=[f"the turn is {len(text):,} characters; tool calls are read in turns of at most "
                                      f"{MAX_PARSED_CHARS:,}"], content=text)
        try:
            message = _streamed(self.response_template, _short_spaces(text), _short_spaces(prefix))
            calls = message.get("tool_calls") or []
            content = str(message.get("content") or "")
        except Exception as err:  # noqa: BLE001 - the model's text is not the format (RecursionError included)
            return ParsedTurn(errors=[f"the tool call could not be read: {type(err).__name__}: {str(err)[:300]}"], content=text)
        turn = ParsedTurn(content=content)
        for i, call in enumerate(calls if isinstance(calls, list) else [calls]):
            if i == MAX_CALLS:
                turn.errors.append(f"more than {MAX_CALLS} tool calls in one turn: the rest were not read")
                break
            function = call.get("function", call) if isinstance(call, dict) else {}
            function = function if isinstance(function, dict) else {}
            try:  # back to text, so one bounded reading checks both formats' calls
                body = json.dumps({"name": function.get("name"), "arguments": function.get("arguments")})
            except (TypeError, ValueError, RecursionError) as err:
                turn.errors.append(f"tool call {i + 1} could not be read: {type(err).__name__}")
                continue
            _add_call(turn, body, i)
        return turn


def _streamed(response_template: Any, text: str, prefix: str) -> dict[str, Any]:
    """transformers' response parser on `text`, fed as a stream: given the whole text at once it
    rescans all of it for every field it finds (32 calls before 30,000 characters took 16 s)."""
    from transformers.utils.chat_parsing import ResponseParser

    parser = ResponseParser(response_template, prefix=prefix)
    for start in range(0, len(text), PARSER_CHUNK):
        parser.feed(text[start:start + PARSER_CHUNK])
    return parser.finalize()[0]


def _short_spaces(text: str) -> str:
    """Every run of whitespace cut to MAX_SPACE_RUN characters: a response template's `\\s*` patterns
    cost the square of a run's length (4,000 spaces took 0.3 s, 100,000 over two minutes)."""
    return _LONG_SPACE.sub(lambda m: m.group()[:MAX_SPACE_RUN], text)


def _model_template(tokenizer: Any) -> str:
    template = tokenizer.chat_template
    if isinstance(template, dict):
        template = template.get("default")
    if not isinstance(template, str):
        raise ValueError("the policy's tokenizer has no chat template to render tools with")
    return template


def _unclosed(body: str) -> str:
    """A call cut off inside its closing tag (`…}\n</tool_`) is read without the tag's start."""
    for k in range(len(CALL_CLOSE) - 1, 0, -1):
        if body.endswith(CALL_CLOSE[:k]):
            return body[:-k].rstrip()
    return body


def _add_call(turn: ParsedTurn, body: str, index: int) -> None:
    """One `{"name": …, "arguments": {…}}` object, or the reason it is not one."""
    try:
        data = loads_bounded(body)
    except JsonTextError as err:
        turn.errors.append(f"tool call {index + 1} is not valid JSON ({err}); write "
                           f'{CALL_OPEN}{{"name": ..., "arguments": {{...}}}}{CALL_CLOSE}')
        return
    arguments = data.get("arguments", data.get("parameters", {})) if isinstance(data, dict) else None
    if isinstance(arguments, str):  # some models write the arguments as a JSON string, as the OpenAI API does
        try:
            arguments = loads_bounded(arguments)
        except JsonTextError:
            arguments = None
    if not isinstance(data, dict) or not isinstance(data.get("name"), str) or not isinstance(arguments, dict):
        turn.errors.append(f'tool call {index + 1} must be an object {{"name": "...", "arguments": {{...}}}}')
        return
    turn.calls.append(ToolCall(name=data["name"], arguments=arguments, id=f"call_{index}"))
