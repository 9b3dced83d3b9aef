"""Declared tools through the real agent loop: rendered by the policy's template (a Qwen-style one
that has a tool format) or the hermes default (SmolLM2's, which has none), parsed back, answered
as `tool` messages; the record stays token-exact and masked, and every malformed call is an
answer the model reads and a count, never a crashed episode."""

import copy
import time

import pytest
from transformers import AutoTokenizer

from opentinker.agent import ChatFormat, EpisodeLimits, run_episodes
from opentinker.backend import SamplingParams
from opentinker.backend.rollout import Completion
from opentinker.core.spec import SpecError, parse_spec
from opentinker.env import AbstractGame, StepResult
from opentinker.model.loading import tokenizer_path
from opentinker.tools.declared import Tool, ToolError
from opentinker.tools.formats import ToolFormat, template_renders_tools
from tests.tool_templates import HERMES_RESPONSE_TEMPLATE, QWEN_STYLE

ADD = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"], "additionalProperties": False}


def _tokenizer(template=None):
    tok = AutoTokenizer.from_pretrained(tokenizer_path())
    if template is not None:
        tok = copy.deepcopy(tok)
        tok.chat_template = template
    return tok


@pytest.fixture(scope="module")
def smol():
    return _tokenizer()


@pytest.fixture(scope="module")
def qwen_style():
    return _tokenizer(QWEN_STYLE)


def _slow(args):
    time.sleep(5)
    return "late"


def _boom(args):
    raise ToolError("the lookup is down")


class AddGame(AbstractGame):
    """Asks for a sum; declares `add` (and two misbehaving tools); grades `Answer: N`."""

    def get_system_prompt(self):
        return "Use the tools."

    def get_tools(self):
        return [Tool("add", "Add two integers.", lambda a: str(a["a"] + a["b"]), ADD),
                Tool("slow", "Never in time.", _slow, timeout_s=0.3),
                Tool("lookup", "Always fails.", _boom)]

    def reset(self, **task):
        return "What is 2 + 3?"

    def step(self, action):
        return StepResult("ok", 1.0 if "Answer: 5" in action else 0.0, True, {"correct": "Answer: 5" in action})


class ScriptedEngine:
    """Replies with fixed texts, one per turn, as if the policy sampled them and stopped."""

    policy_version = 0

    def __init__(self, tok, replies):
        self.tok, self.replies, self.turn, self.prompts = tok, replies, 0, []

    def generate(self, prompts, params, budgets=None, **_):
        self.prompts.append(list(prompts[0]))
        ids = self.tok(self.replies[self.turn], add_special_tokens=False)["input_ids"] + [self.tok.eos_token_id]
        self.turn += 1
        return [Completion(token_ids=list(ids), logprobs=[-0.5] * len(ids), finish_reason="stop") for _ in prompts]


def _call(name, **arguments):
    import json

    return f'<tool_call>\n{json.dumps({"name": name, "arguments": arguments})}\n</tool_call>'


def _play(tok, replies, game=None, **limits):
    engine = ScriptedEngine(tok, replies)
    (traj,) = run_episodes(engine, ChatFormat(tok), [game or AddGame()], [{}], SamplingParams(max_new_tokens=64),
                           EpisodeLimits(**({"max_turns": 6, "max_total_tokens": 4096} | limits)))
    return traj, engine


def _assert_exact(tok, traj):
    """The record is the template's rendering of the conversation: sampled tokens (mask 1) plus the
    template's own text around them (mask 0), nothing re-tokenized differently."""
    sampled = {i for t in traj.turns for i in range(t.sampled_start, t.sampled_end)}
    assert traj.loss_mask == [1 if i in sampled else 0 for i in range(len(traj.token_ids))]
    for turn in traj.turns:
        assert tok.decode(traj.token_ids[turn.sampled_start:turn.sampled_end], skip_special_tokens=True) == turn.action
    rendered = ChatFormat(tok).tools.render(traj.messages, [t.schema() for t in AddGame().get_tools()], add_generation_prompt=False)
    assert tok.decode(traj.token_ids) == rendered.rstrip("\n")


def test_formats_are_told_apart(smol, qwen_style):
    assert not template_renders_tools(smol) and ToolFormat(smol).name == "hermes"
    assert template_renders_tools(qwen_style) and ToolFormat(qwen_style).name == "template"
    with pytest.raises(ValueError, match="does not render tools"):
        ToolFormat(smol, "template")


@pytest.mark.parametrize("which", ["smol", "qwen_style"])
def test_a_tool_episode_is_token_exact_in_either_format(which, request):
    tok = request.getfixturevalue(which)
    traj, engine = _play(tok, [_call("add", a=2, b=3), "Answer: 5"])
    assert not traj.failed and traj.stop_reason == "done" and traj.reward == 1.0
    assert traj.info == {"tool_calls": 1, "tool_invalid": 0, "tool_errors": 0, "correct": True}
    assert [m["role"] for m in traj.messages][-3:] == ["assistant", "tool", "assistant"] and traj.messages[-2]["content"] == "5"
    _assert_exact(tok, traj)
    first = tok.decode(engine.prompts[0])
    assert '"name": "add"' in first and "<tools>" in first  # the tools were rendered into the prompt
    assert "<tool_response>\n5\n</tool_response>" in tok.decode(engine.prompts[1])


def test_qwen_style_template_groups_a_turns_results_its_own_way(qwen_style):
    traj, _ = _play(qwen_style, [_call("add", a=1, b=1) + "\n" + _call("add", a=2, b=2), "Answer: 5"])
    text = qwen_style.decode(traj.token_ids)
    assert "<|im_start|>user\n<tool_response>\n2\n</tool_response>\n<tool_response>\n4\n</tool_response><|im_end|>" in text
    _assert_exact(qwen_style, traj)


@pytest.mark.parametrize("reply, kind, says", [
    ('<tool_call>{"name": "add", "arguments": {"a": 2,</tool_call>', "tool_invalid", "not valid JSON"),
    ('<tool_call>["add", 2, 3]</tool_call>', "tool_invalid", "must be an object"),
    (_call("subtract", a=2, b=3), "tool_invalid", 'no tool named "subtract" (tools: add, slow, lookup)'),
    (_call("add", a=2), "tool_invalid", "'b' is a required property"),
    (_call("add", a=2, b="3"), "tool_invalid", "b: '3' is not of type 'integer'"),
    (_call("add", a=2, b=3, c=4), "tool_invalid", "Additional properties are not allowed"),
    (_call("lookup"), "tool_errors", "error: the lookup is down"),
    (_call("slow"), "tool_errors", "error: timed out after 0.3s"),
])
def test_a_malformed_or_failed_call_is_an_answer_and_a_count(smol, reply, kind, says):
    traj, _ = _play(smol, [reply, "Answer: 5"])
    assert not traj.failed and traj.reward == 1.0  # the episode went on to its answer
    assert traj.info["tool_calls"] == 1 and traj.info["tool_errors"] == 1 and traj.info["tool_invalid"] == (kind == "tool_invalid")
    assert traj.messages[-2]["role"] == "tool" and says in traj.messages[-2]["content"]
    _assert_exact(smol, traj)


def test_calls_past_the_turns_limit_are_not_run(smol):
    traj, _ = _play(smol, ["\n".join(_call("add", a=i, b=1) for i in range(6)), "Answer: 5"], max_tool_calls_per_turn=4)
    results = [m["content"] for m in traj.messages if m["role"] == "tool"]
    assert results[:4] == ["1", "2", "3", "4"] and all("at most 4 tool calls a turn" in r for r in results[4:])
    assert traj.info == {"tool_calls": 6, "tool_invalid": 2, "tool_errors": 2, "correct": True}


def test_job_tools_join_the_games_and_clashing_names_cost_the_episode(smol):
    double = Tool("double", "Twice a number.", lambda a: str(2 * a["x"]), {"type": "object", "properties": {"x": {"type": "integer"}}})
    traj, engine = _play(smol, [_call("double", x=4), "Answer: 5"], tools=[double])
    assert traj.messages[-2]["content"] == "8" and '"name": "double"' in smol.decode(engine.prompts[0])
    clash, _ = _play(smol, ["Answer: 5"], tools=[Tool("add", "Another add.", lambda a: "0")])
    assert clash.failed and "the tool 'add' is declared by the job's env.tools and by the game" in clash.failure


def test_a_turn_without_a_call_goes_to_the_game_and_games_without_tools_are_unchanged(smol):
    traj, engine = _play(smol, ["The answer is five. Answer: 5"])
    assert traj.reward == 1.0 and traj.info == {"tool_calls": 0, "tool_invalid": 0, "tool_errors": 0, "correct": True}

    class Plain(AddGame):
        def get_tools(self):
            return []

    plain, engine = _play(smol, ["Answer: 5"], game=Plain())
    assert plain.info == {"correct": True} and "<tools>" not in smol.decode(engine.prompts[0])


def test_spec_env_tools():
    base = {"model": {"name": "tiny-random"}, "env": {"game": "envs.units:UnitsGame"}}
    spec = parse_spec(base | {"env": base["env"] | {"tools": [{"mcp": "http://127.0.0.1:9/mcp", "timeout_s": 5}, {"python": {"wall_s": 2}}]}})
    assert spec.env.tools[0].mcp == "http://127.0.0.1:9/mcp" and spec.env.tools[1].python.wall_s == 2
    for bad, says in [({"mcp": "file:///etc/passwd"}, "must start with http"), ({"python": {"wall_s": 0}}, "greater than 0"),
                      ({"shell": "bash"}, "env.tools.0"), ({"python": {"memory_mb": 10**9}}, "less than or equal")]:
        with pytest.raises(SpecError, match=says):
            parse_spec(base | {"env": base["env"] | {"tools": [bad]}})


def test_a_call_cut_off_inside_its_closing_tag_is_still_read(smol):
    turn = ToolFormat(smol).parse('<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_')
    assert [(c.name, c.arguments) for c in turn.calls] == [("add", {"a": 2, "b": 3})] and not turn.errors


def test_a_hostile_pattern_in_a_tools_schema_is_not_run(smol):
    """A tenant's MCP server declares the schema: a catastrophic regular expression must not spin the worker."""
    evil = {"type": "object", "properties": {"q": {"type": "string", "pattern": "^(a+)+$"}},
            "patternProperties": {"^(b+)+$": {"type": "string"}}, "additionalProperties": False}

    class Evil(AddGame):
        def get_tools(self):
            return [Tool("search", "Search.", lambda a: "found", evil)]

    started = time.perf_counter()
    traj, _ = _play(smol, [_call("search", q="a" * 40 + "!"), "Answer: 5"], game=Evil())
    assert traj.messages[-2]["content"] == "found" and time.perf_counter() - started < 30


def test_a_served_games_tools_arrive_as_plain_fields(smol):
    """Games of the env layer (an OpenEnv MCP environment) declare GameTools; the loop takes them as Tools."""
    from opentinker.env.base import GameTool, ToolFailure

    def lookup(arguments):
        raise ToolFailure("no such key")

    class Served(AddGame):
        def get_tools(self):
            return [GameTool(name="lookup", description="Look up a key.", run=lookup)]

    traj, _ = _play(smol, [_call("lookup", key="x"), "Answer: 5"], game=Served())
    assert traj.messages[-2]["content"] == "error: no such key" and traj.info["tool_errors"] == 1


@pytest.fixture
def parsing(qwen_style, monkeypatch):
    """A copy of the Qwen-style tokenizer with a response parser, and the prefixes transformers'
    response parser (which formats.py feeds as a stream) was started with."""
    from transformers.utils import chat_parsing

    tok = copy.deepcopy(qwen_style)
    tok.response_template = HERMES_RESPONSE_TEMPLATE
    seen = []

    class Seen(chat_parsing.ResponseParser):
        def __init__(self, template, prefix=None, **kwargs):
            seen.append(prefix)
            super().__init__(template, prefix, **kwargs)

    monkeypatch.setattr(chat_parsing, "ResponseParser", Seen)
    return tok, seen


def test_calls_are_parsed_by_the_tokenizers_response_parser(parsing):
    tok, seen = parsing
    tools = ToolFormat(tok)
    assert tools.name == "template" and tools.response_template is HERMES_RESPONSE_TEMPLATE
    turn = tools.parse("Let me add.\n" + _call("add", a=2, b=3) + "\n" + _call("add", a=1, b=1))
    assert seen == [""]  # through the response parser, with the explicit empty prefix (None raises in transformers 5)
    assert [(c.name, c.arguments, c.id) for c in turn.calls] == [("add", {"a": 2, "b": 3}, "call_0"), ("add", {"a": 1, "b": 1}, "call_1")]
    assert turn.content == "Let me add." and not turn.errors
    plain = tools.parse("Answer: 5")
    assert not plain.attempted and plain.content == "Answer: 5" and len(seen) == 2
    # the parsed message formats.py reads its calls from
    assert tok.parse_response(_call("add", a=2, b=3), prefix="")["tool_calls"] == [
        {"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}]


def test_a_tool_episode_with_a_response_parser_is_token_exact(parsing):
    tok, seen = parsing
    traj, engine = _play(tok, [_call("add", a=2, b=3), "Answer: 5"])
    assert len(seen) == 2  # both turns were read by the response parser
    assert not traj.failed and traj.stop_reason == "done" and traj.reward == 1.0
    assert traj.info == {"tool_calls": 1, "tool_invalid": 0, "tool_errors": 0, "correct": True}
    assert [m["role"] for m in traj.messages][-3:] == ["assistant", "tool", "assistant"] and traj.messages[-2]["content"] == "5"
    _assert_exact(tok, traj)
    assert "<tool_response>\n5\n</tool_response>" in tok.decode(engine.prompts[1])


def test_text_the_response_parser_cannot_read_is_an_error_line_and_the_episode_goes_on(parsing):
    tok, seen = parsing
    bad = '<tool_call>{"name": "add", "arguments": {"a": 2,</tool_call>'
    turn = ToolFormat(tok).parse(bad)
    assert not turn.calls and len(turn.errors) == 1 and turn.errors[0].startswith("the tool call could not be read: ValueError")
    assert seen == [""]
    traj, _ = _play(tok, [bad, "Answer: 5"])
    assert not traj.failed and traj.reward == 1.0
    assert traj.info == {"tool_calls": 1, "tool_invalid": 1, "tool_errors": 1, "correct": True}
    assert traj.messages[-2]["role"] == "tool" and "could not be read" in traj.messages[-2]["content"]
    _assert_exact(tok, traj)
