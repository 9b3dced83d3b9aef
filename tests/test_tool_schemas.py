"""Tenant-given tool schemas cannot cost unbounded time or memory (opentinker.core.schema_cost).

A real MCP server on 127.0.0.1 lists the schema that spun a job (`anyOf` of two `$ref`s to the next
level, 28 `$defs` deep: 2^28 subschemas for one wrong argument): the listing refuses it in one line
naming the tool and the server, the job's start is refused, and the process's memory stays where
it was. A schema that passes but is slow to check errs within the call's time, and one whose
recursion passes but explodes stops at the step budget; the episode goes on. Every schema shipped
or used in the tests, OpenAI's examples and pydantic's shapes pass.
"""

from __future__ import annotations

import re
import threading
import time
from typing import Literal

import psutil
import pytest

pytest.importorskip("mcp", reason="pip install mcp fastmcp")
from fastmcp import FastMCP
from fastmcp.tools import Tool as ServedTool
from fastmcp.tools import ToolResult
from mcp.types import TextContent

from opentinker.agent.guard import call_with_timeout, stuck_calls
from opentinker.core import schema_cost
from opentinker.core.env_hosts import EnvHosts
from opentinker.core.schema_cost import SchemaRefused, check_cost
from opentinker.tools.declared import Tool, ToolCall
from opentinker.tools.formats import ParsedTurn
from opentinker.tools.job_tools import JobTools
from opentinker.tools.mcp import McpTools
from opentinker.tools.toolbox import ToolBox, validator_of
from tests.conftest import tiny_spec
from tests.served import ServedApp

LOOPBACK = EnvHosts.parse("127.0.0.0/8")
RSS_BOUND = 300 * 1024**2  # generous: the attack took gigabytes


def doubling_chain(depth: int) -> dict:
    """The attack: each level is anyOf of two $refs to the next, the last an integer."""
    defs = {f"l{i}": {"anyOf": [{"$ref": f"#/$defs/l{i + 1}"}, {"$ref": f"#/$defs/l{i + 1}"}]} for i in range(depth)}
    defs[f"l{depth}"] = {"type": "integer"}
    return {"type": "object", "properties": {"x": {"$ref": "#/$defs/l0"}}, "required": ["x"], "$defs": defs}


def recursive_union() -> dict:
    """Passes the listing (its recursion goes into the arguments) but doubles with every level of them."""
    node = {"type": "object", "anyOf": [{"properties": {"a": {"$ref": "#/$defs/n"}}, "required": ["a"]},
                                        {"properties": {"a": {"$ref": "#/$defs/n"}}, "required": ["a"]}]}
    return {"type": "object", "properties": {"tree": {"$ref": "#/$defs/n"}}, "$defs": {"n": node}}


SLOW_ENUM = [{"id": i, "tag": f"t{i}"} for i in range(2000)]  # 50 KB: under the size limit
SLOW = {"type": "object", "properties": {"picks": {"type": "array", "items": {"enum": SLOW_ENUM}}}, "required": ["picks"]}
SLOW_PICKS = [dict(SLOW_ENUM[-1]) for _ in range(20_000)]  # each compared with all 2,000 entries: minutes of jsonschema
REACHED: list[dict] = []  # the calls that reached a server's tool


class Declared(ServedTool):
    """A server's tool with the input schema the server chooses (fastmcp's Tool subclass)."""

    async def run(self, arguments):
        REACHED.append(arguments)
        return ToolResult(content=[TextContent(type="text", text="ran")])


def _serve(**schemas: dict):
    server = FastMCP("tenant")
    for name, schema in schemas.items():
        server.add_tool(Declared(name=name, description=f"The {name} tool.", parameters=schema))
    served = ServedApp(lambda: server.http_app(path="/mcp"))
    return served, f"{served.url}/mcp"


@pytest.fixture(scope="module")
def hostile():
    """A tenant's MCP server listing the attack."""
    served, url = _serve(deep=doubling_chain(28), fine={"type": "object", "properties": {}})
    yield url
    served.stop()


@pytest.fixture(scope="module")
def passing():
    """A tenant's MCP server whose schemas pass the listing but are costly to check."""
    served, url = _serve(slow=SLOW, nested=recursive_union())
    yield url
    served.stop()


def _rss() -> int:
    return psutil.Process().memory_info().rss


def test_the_exponential_schema_is_refused_at_listing_in_one_line_naming_the_tool_and_server(hostile):
    before, REACHED[:] = _rss(), []
    with pytest.raises(ValueError) as refused:
        McpTools(hostile, LOOPBACK, timeout_s=10).tools()
    message = str(refused.value)
    assert message == (f"env.tools.mcp: {hostile}: the tool 'deep''s input schema expands to more than 10,000 subschemas "
                       "through $ref and its combinators, each branch counted (refused)")
    assert _rss() - before < RSS_BOUND and not REACHED


def test_a_job_whose_mcp_server_lists_it_is_refused_at_its_start(hostile, tmp_path, monkeypatch):
    """The real job: its sampler lists the tools when it starts, and the start fails in that one line."""
    from opentinker.rl import RLJob

    monkeypatch.setenv("OPENTINKER_ENV_URL_ALLOW", "127.0.0.0/8")
    spec = tiny_spec(tmp_path, env={"game": "envs.units:UnitsGame", "tools": [{"mcp": hostile, "timeout_s": 10}]},
                     checkpoint={"every": 0})
    before = _rss()
    with pytest.raises(ValueError, match=r"^env\.tools\.mcp: .*: the tool 'deep''s input schema expands to more than") as refused:
        RLJob(spec, job_id="job-deep-schema")
    assert "\n" not in str(refused.value) and _rss() - before < RSS_BOUND


def test_job_tools_refuse_it_too_and_close_the_session(hostile):
    spec = tiny_spec("/tmp", env={"game": "envs.units:UnitsGame", "tools": [{"mcp": hostile, "timeout_s": 10}]})
    with pytest.raises(ValueError, match="'deep''s input schema expands"):
        JobTools(spec.env.tools, LOOPBACK)


def _box(url: str) -> tuple[McpTools, ToolBox]:
    server = McpTools(url, LOOPBACK, timeout_s=0.5)
    return server, ToolBox(server.tools())


def _answer(box: ToolBox, name: str, arguments: dict):
    (result,) = box.answer(ParsedTurn(calls=[ToolCall(name, arguments, "call_0")]), call_with_timeout)
    return result


def _ended(calls_stuck_before: int) -> bool:
    """Whether the calls abandoned since have all returned within 30 s (generous: a check left to
    run on would hold its thread for minutes)."""
    end = time.monotonic() + 30
    while stuck_calls() > calls_stuck_before and time.monotonic() < end:
        time.sleep(0.05)
    return stuck_calls() <= calls_stuck_before


def test_a_check_slower_than_the_calls_time_is_its_error_in_time_and_the_episode_goes_on(passing):
    """`slow` passes the listing; checking 20,000 picks (40,000 steps) against its 2,000-entry enum
    takes minutes, past the call's 2.5 s: the call is a timeout the model reads, the server never
    hears of it, the check's thread stops itself (not minutes later), and the next call of the
    episode is answered."""
    server, box = _box(passing)
    try:
        assert box.tools["slow"].timeout_s == 2.5
        REACHED.clear()
        stuck = stuck_calls()
        result = _answer(box, "slow", {"picks": SLOW_PICKS})
        assert result.error == "timeout", result.content
        assert result.content == "error: arguments: checking them against the schema ran past the call's time (2.5s, the tool's timeout)"
        assert box.counts == {"tool_calls": 1, "tool_invalid": 0, "tool_errors": 1} and not REACHED
        assert _ended(stuck)  # the check stopped at its deadline: no thread left running it
        assert _answer(box, "slow", {"picks": SLOW_PICKS[:3]}).content == "ran" and len(REACHED) == 1
    finally:
        server.close()


def test_a_recursion_that_passes_the_listing_stops_at_the_step_budget_with_memory_bounded(passing):
    """`nested` doubles with each level of the arguments: 40 levels would be 2^40 subschemas."""
    server, box = _box(passing)
    try:
        tree: dict | int = 5
        for _ in range(40):
            tree = {"a": tree}
        before = _rss()
        result = _answer(box, "nested", {"tree": tree})
        assert (result.error, result.content) == ("bad_arguments", "error: arguments: checking them against the schema takes over "
                                                                  "50,000 steps (not checked)")
        assert _rss() - before < RSS_BOUND and box.counts["tool_invalid"] == 1
        assert _answer(box, "nested", {"tree": {"a": {"a": {}}}}).error == "bad_arguments"  # a plain failure, in a few steps
    finally:
        server.close()


def test_a_game_s_own_tool_with_the_schema_costs_its_episode_not_the_job():
    """A game's tools are checked when the episode's ToolBox is made (inside its bounded reset)."""
    with pytest.raises(ValueError, match=r"^tool 'deep': its parameters schema expands to more than 10,000 subschemas"):
        ToolBox([Tool("deep", "", lambda a: "x", doubling_chain(28))])


@pytest.mark.parametrize("schema, reason", [
    ({"$ref": "#"}, "comes back to '#' through $ref without going into the arguments (a check would never end)"),
    ({"$defs": {"a": {"anyOf": [{"type": "string"}, {"$ref": "#/$defs/b"}]}, "b": {"not": {"$ref": "#/$defs/a"}}},
      "$ref": "#/$defs/a"}, "comes back to '#/$defs/a'"),
    ({"properties": {"x": {"$ref": "https://example.com/s.json"}}}, "only references inside the schema, '#...', are followed"),
    ({"properties": {"x": {"$ref": "#/$defs/missing"}}}, "refers to '#/$defs/missing', which is not in it"),
    ({"properties": {"x": {"$dynamicRef": "#meta"}}}, "uses $dynamicRef"),
    ({"properties": {"x": {"$id": "https://example.com/x", "type": "string"}}}, "has an $id inside it"),
    ({"properties": {"x": {"enum": ["a" * 100] * 1000}}}, "bytes of JSON, over the limit of 65,536"),
    ({"$defs": {f"d{i}": {"type": "string"} for i in range(300)}, "allOf": [{"$ref": f"#/$defs/d{i}"} for i in range(300)]},
     "has 300 $refs, over the limit of 256"),
])
def test_what_the_listing_refuses_and_why(schema, reason):
    with pytest.raises(SchemaRefused, match=re.escape(reason)):
        check_cost(schema)


def test_a_schema_100000_levels_deep_is_refused_without_recursing_into_it():
    schema: dict = {}
    for _ in range(100_000):
        schema = {"not": schema}
    with pytest.raises(SchemaRefused, match="nests more than 64 levels deep"):
        check_cost(schema)


def test_unevaluated_properties_count_the_applicators_they_evaluate_again():
    """jsonschema evaluates a node's applicators again for unevaluatedProperties: chains of them multiply."""
    plain = {"allOf": [{"properties": {f"p{i}": {"type": "string"} for i in range(10)}}]}
    assert check_cost({**plain, "unevaluatedProperties": False}) > 2 * check_cost(plain)


def test_the_counted_keywords_are_draft_2020_12s_applicators():
    """Every keyword that applies a subschema, read from the Draft 2020-12 meta-schemas, with its shape."""
    from jsonschema_specifications import REGISTRY

    found = {}
    for vocabulary in ("applicator", "unevaluated"):
        for keyword, rule in REGISTRY.contents(f"https://json-schema.org/draft/2020-12/meta/{vocabulary}")["properties"].items():
            shape = "list" if rule.get("$ref") == "#/$defs/schemaArray" else "map" if "additionalProperties" in rule else "one"
            found[keyword] = shape
    assert {k: shape for k, (shape, _) in schema_cost.APPLICATORS.items()} == found
    down = {k for k, (_, into) in schema_cost.APPLICATORS.items() if into}
    assert down == {"prefixItems", "items", "contains", "additionalProperties", "properties", "patternProperties", "propertyNames",
                    "unevaluatedItems", "unevaluatedProperties"}


# --- every sensible schema passes ---------------------------------------------------------------

OPENAI_EXAMPLES = [
    {"type": "object", "properties": {"location": {"type": "string", "description": "City and country e.g. Bogotá, Colombia"},
                                      "units": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
     "required": ["location", "units"], "additionalProperties": False},
    {"type": "object", "properties": {"order_id": {"type": "string"}, "items": {"type": "array", "items": {
        "type": "object", "properties": {"sku": {"type": "string"}, "quantity": {"type": "integer", "minimum": 1}},
        "required": ["sku", "quantity"], "additionalProperties": False}}}, "required": ["order_id", "items"], "additionalProperties": False},
    {"type": "object", "properties": {"ui": {"$ref": "#/$defs/ui"}}, "$defs": {"ui": {  # OpenAI's recursive UI example
        "type": "object", "properties": {"type": {"type": "string", "enum": ["div", "button", "header", "section", "field", "form"]},
                                         "label": {"type": "string"}, "children": {"type": "array", "items": {"$ref": "#/$defs/ui"}},
                                         "attributes": {"type": "array", "items": {"$ref": "#/$defs/attribute"}}},
        "required": ["type", "label", "children", "attributes"], "additionalProperties": False},
        "attribute": {"type": "object", "properties": {"name": {"type": "string"}, "value": {"type": "string"}},
                      "required": ["name", "value"], "additionalProperties": False}}},
    {"type": "object", "properties": {"item": {"anyOf": [
        {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "number"}}, "required": ["name", "age"]},
        {"type": "object", "properties": {"number": {"type": "string"}, "street": {"type": "string"}}, "required": ["number", "street"]}]}}},
]


def _pydantic_schemas() -> list[dict]:
    """What fastmcp and pydantic write for ordinary argument types: optionals, nested models, a
    discriminated union, a recursive tree, a JSON value of any shape."""
    from pydantic import BaseModel, Field, JsonValue, TypeAdapter

    class Address(BaseModel):
        street: str
        city: str
        zip: str | None = Field(default=None, pattern=r"^\d{5}$")

    class Person(BaseModel):
        name: str
        addresses: list[Address]
        tags: dict[str, int] = {}

    class Cat(BaseModel):
        kind: Literal["cat"]
        lives: int

    class Dog(BaseModel):
        kind: Literal["dog"]
        good: bool

    class Node(BaseModel):
        value: str
        children: list[Node] = []

    class Expr(BaseModel):
        op: Literal["add", "mul", "num"]
        args: list[Expr | float] = []

    class Call(BaseModel):
        person: Person
        pet: Cat | Dog = Field(discriminator="kind")
        tree: Node
        expr: Expr
        extra: JsonValue = None

    return [TypeAdapter(Call).json_schema()]


def _listed_tools() -> list[tuple[str, dict]]:
    """The tools the shipped environments and the tests' servers list, as the job receives them."""
    from envs.math_tool.game import CALCULATOR
    from envs.units.server import app as units_app
    from opentinker.tools.sandbox import Sandbox, SandboxLimits, python_tool
    from tests.test_mcp_tools import CounterEnv, unit_server

    out = [("calculator", CALCULATOR), ("python", python_tool(Sandbox(SandboxLimits())).parameters)]
    for name, server in (("units", units_app()), ("tests' units", unit_server()), ("counter", CounterEnv().mcp_server)):
        served = ServedApp(lambda server=server: server.http_app(path="/mcp"))
        try:
            out += [(f"{name}: {t.name}", t.parameters) for t in McpTools(f"{served.url}/mcp", LOOPBACK, timeout_s=10).tools()]
        finally:
            served.stop()
    return out


def test_every_shipped_tested_and_ordinary_schema_passes():
    schemas = [(f"openai {i}", s) for i, s in enumerate(OPENAI_EXAMPLES)] + [("pydantic", s) for s in _pydantic_schemas()]
    schemas += _listed_tools()
    assert len(schemas) > 10
    for name, schema in schemas:
        ToolBox([Tool("t", "", lambda a: "x", schema)])  # the same check a listing makes, and a validator built
        assert check_cost(schema) < schema_cost.MAX_SUBSCHEMAS / 10, name  # far from the limit


def test_a_regular_expression_of_the_schema_never_runs_and_property_names_are_kept():
    """`pattern`, `patternProperties` and `format` are not checked (a catastrophic pattern spins in C,
    out of the step count's reach); a property *named* `pattern` or `format` is still checked."""
    schema = {"type": "object", "properties": {"pattern": {"type": "string", "pattern": "^(a+)+$"}, "format": {"type": "integer"}},
              "patternProperties": {"^(b+)+$": {"type": "string"}}, "additionalProperties": False, "unevaluatedProperties": False}
    box = ToolBox([Tool("t", "", lambda a: "ran", schema)])
    assert _answer(box, "t", {"pattern": "a" * 40 + "!", "bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb!": 1}).content == "ran"
    bad = _answer(box, "t", {"pattern": "a", "format": "not a number"})
    assert (bad.error, bad.content) == ("bad_arguments", "error: format: 'not a number' is not of type 'integer'")


def test_validators_are_built_once_per_schema():
    """A game's tools are new objects each episode, with the same schema: one validator serves all."""
    first = Tool("t", "", lambda a: "x", {"type": "object", "properties": {"n": {"type": "integer"}}})
    second = Tool("u", "", lambda a: "y", {"properties": {"n": {"type": "integer"}}, "type": "object"})
    assert validator_of(first) is validator_of(second)


def test_checks_of_many_episodes_at_once_keep_their_own_budgets():
    """The step budget is the check's own (a context variable), not shared by threads checking at once."""
    box = ToolBox([Tool("t", "", lambda a: "ok", {"type": "object", "properties": {"xs": {"type": "array", "items": {"type": "integer"}}}})])
    answers: list = []

    def one() -> None:
        answers.append(_answer(box, "t", {"xs": list(range(10_000))}).content)  # over 10,000 steps each: 8 at once would pass 50,000

    threads = [threading.Thread(target=one) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert answers == ["ok"] * 8


# --- OpenEnv: an MCP environment's tools and the action schema ------------------------------------

def test_an_openenv_environments_exponential_tool_or_action_schema_costs_the_episode_in_one_line():
    """An OpenEnv MCP environment listing the attack as a tool, and a server whose /schema is the
    attack as its action: each episode fails in one line naming the server, nothing expanded."""
    pytest.importorskip("openenv", reason="pip install 'opentinker[openenv]'")
    from openenv.core.env_server.mcp_environment import MCPEnvironment
    from openenv.core.env_server.types import Action, Observation, State
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    from opentinker.env.openenv_client import OpenEnvGameClass
    from opentinker.env.openenv_server import create_openenv_app
    from opentinker.env.remote import RemoteGameError

    class Plain(Action):
        message: str = ""

    class Seen(Observation):
        text: str = ""

    class DeepToolEnv(MCPEnvironment):
        SUPPORTS_CONCURRENT_SESSIONS = True

        def __init__(self) -> None:
            server = FastMCP("deep")
            server.add_tool(Declared(name="deep", description="Deep.", parameters=doubling_chain(28)))
            super().__init__(server)

        def reset(self, seed=None, episode_id=None, **kwargs) -> Seen:
            return Seen(text="ready")

        def _step_impl(self, action, timeout_s=None, **kwargs) -> Seen:
            return Seen(text="done", reward=1.0, done=True)

        @property
        def state(self) -> State:
            return State(step_count=0)

    tools = ServedApp(lambda: create_openenv_app(DeepToolEnv, Plain, Seen))
    action = ServedApp(lambda: Starlette(routes=[Route("/schema", lambda request: JSONResponse({"action": doubling_chain(28)}))]))
    before, REACHED[:] = _rss(), []
    try:
        game = OpenEnvGameClass(tools.url, timeout_s=5, retries=0, hosts=LOOPBACK)()
        assert game.reset(__seed__=1) == "ready"
        with pytest.raises(RemoteGameError) as refused:
            game.get_tools()
        game.close()
        assert str(refused.value) == (f"tools/list {tools.url}: the tool 'deep''s input schema expands to more than 10,000 subschemas "
                                      "through $ref and its combinators, each branch counted (refused)")
        with pytest.raises(RemoteGameError, match=rf"^GET {action.url}/schema: the action schema expands to more than 10,000 "):
            OpenEnvGameClass(action.url, timeout_s=5, retries=0, hosts=LOOPBACK)().reset(__seed__=1)
    finally:
        tools.stop()
        action.stop()
    assert _rss() - before < RSS_BOUND and not REACHED
