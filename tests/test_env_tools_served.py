"""A game's tools travel with it when it is served (`opentinker env serve`) or linked (it stays in
the user's process, reached through the gateway's client link): the real agent loop renders the
tools the host listed, each call runs that episode's own tool on the host, and its answer (or its
error) comes back as a `tool` message. The host is the tenant's: a malformed tool list costs its
episode, with the reason, never the job.

Every server here is a real uvicorn on 127.0.0.1, in a background thread of the test process; the
link goes through a real LinkHub (the gateway's relay) and a real EnvironmentLink."""

from __future__ import annotations

import re
import time
import uuid

import httpx
import pytest
from fastapi import FastAPI, Request, WebSocket
from fastapi.responses import StreamingResponse

from opentinker.agent import ChatFormat, EpisodeLimits, run_episodes
from opentinker.backend import SamplingParams
from opentinker.backend.rollout import Completion
from opentinker.client.link import EnvironmentLink
from opentinker.control.gateway.link import LinkHub, valid_calls
from opentinker.env import AbstractGame, StepResult
from opentinker.env.base import GameTool, ToolFailure
from opentinker.env.linked import LinkedGameClass
from opentinker.env.remote import RemoteGameClass
from opentinker.env.served_tools import MAX_DESCRIPTION_CHARS, call_reply, tools_from_listing
from opentinker.env.server import create_app
from opentinker.tools.declared import Tool, ToolError
from tests.served import ServedApp
from tests.test_tool_calls import ScriptedEngine, _call, _tokenizer
from tests.test_tool_schemas import doubling_chain

LIMIT = 4 * 1024**2
COUNT = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}


def _refuse(arguments):
    raise ToolError("the lookup is down")


def _crash(arguments):
    raise RuntimeError("secret path /srv/tenant/keys")


def _refuse_plainly(arguments):
    raise ToolFailure("no such key")


def _slow(arguments):
    time.sleep(3)
    return "late"


class CounterGame(AbstractGame):
    """Each episode's own counter: the `add` tool changes it, the final answer reports it."""

    def get_system_prompt(self):
        return "Use the tools."

    def reset(self, start=0, **_):
        self.total = start
        return f"The counter starts at {start}."

    def get_tools(self):
        return [Tool("add", "Add n to this episode's counter.", self._add, COUNT, timeout_s=5),
                Tool("lookup", "Always fails.", _refuse),
                Tool("crash", "A bug.", _crash),
                GameTool("key", "A key's value.", _refuse_plainly),
                Tool("slow", "Never in time.", _slow, timeout_s=0.5)]

    def _add(self, arguments):
        self.total += arguments["n"]
        return f"total {self.total}"

    def step(self, action):
        return StepResult(f"final {self.total}", float(self.total), True, {"total": self.total})


class PerEpisodeEngine(ScriptedEngine):
    """ScriptedEngine whose replies depend on the episode (its start, read from the prompt) and its turn."""

    def __init__(self, tok, replies_by_start):
        super().__init__(tok, [])
        self.by_start = replies_by_start

    def generate(self, prompts, params, budgets=None, **_):
        out = []
        for prompt in prompts:
            self.prompts.append(list(prompt))
            text = self.tok.decode(prompt)
            start = int(re.search(r"starts at (-?\d+)", text).group(1))
            reply = self.by_start[start][text.count("<|im_start|>assistant") - 1]
            ids = self.tok(reply, add_special_tokens=False)["input_ids"] + [self.tok.eos_token_id]
            out.append(Completion(token_ids=list(ids), logprobs=[-0.5] * len(ids), finish_reason="stop"))
        return out


@pytest.fixture(scope="module")
def smol():
    return _tokenizer()


def _play(tok, game_class, starts, replies):
    engine = PerEpisodeEngine(tok, replies)
    trajs = run_episodes(engine, ChatFormat(tok), [game_class() for _ in starts], [{"start": s} for s in starts],
                         SamplingParams(max_new_tokens=64), EpisodeLimits(max_turns=4, max_total_tokens=4096, max_tool_calls_per_turn=8))
    return trajs, engine


def _gateway_app():
    """The gateway's two link routes (without its tenant checks): the client's WebSocket, the job's calls."""
    hub = LinkHub(max_answer_bytes=LIMIT)
    app = FastAPI()

    @app.websocket("/v1/jobs/{job_id}/link")
    async def client_link(socket: WebSocket, job_id: str) -> None:
        await hub.serve_client(job_id, socket, socket.query_params.get("client"))

    @app.post("/v1/internal/jobs/{job_id}/link")
    async def job_link(job_id: str, request: Request) -> StreamingResponse:
        calls, timeout_s = valid_calls(await request.json())
        return StreamingResponse(hub.relay(job_id, calls, timeout_s), media_type="application/x-ndjson")

    return app


@pytest.fixture
def hosted(request):
    """(game class as the job sees it, how many sessions the host still holds) for the game served or linked."""
    way, game = (request.param, CounterGame) if isinstance(request.param, str) else request.param
    if way == "served":
        served = ServedApp(lambda: create_app(game))
        yield RemoteGameClass(served.url, timeout_s=10, retries=0, max_response_bytes=LIMIT), \
            lambda: httpx.get(f"{served.url}/health").json()["sessions"]
        served.stop()
    else:
        gateway = ServedApp(_gateway_app)
        job_id = f"job-{uuid.uuid4().hex[:8]}"
        link = EnvironmentLink(gateway.url, None, job_id, game).open()
        yield LinkedGameClass(gateway.url, job_id, "otj_token", timeout_s=10, link_timeout_s=5, max_answer_bytes=LIMIT), \
            lambda: len(link._sessions)
        link.close()
        gateway.stop()


@pytest.mark.parametrize("hosted", ["served", "linked"], indirect=True)
def test_a_hosted_games_tools_reach_the_model_and_act_on_its_own_episode(smol, hosted):
    game_class, sessions = hosted
    calls = "\n".join([_call("add", n=2), _call("lookup", q="x"), _call("crash"), _call("key", k="a"), _call("slow")])
    trajs, engine = _play(smol, game_class, [10, 100], {10: [_call("add", n=5), "done"], 100: [calls, "done"]})
    first, second = trajs
    assert not first.failed and not second.failed, (first.failure, second.failure)
    prompt = smol.decode(engine.prompts[0])
    assert '"name": "add"' in prompt and "Add n to this episode's counter." in prompt and '"n": {"type": "integer"}' in prompt
    # each episode's counter moved by its own call only
    assert first.reward == 15.0 and first.info["total"] == 15 and second.reward == 102.0 and second.info["total"] == 102
    assert [m["content"] for m in first.messages if m["role"] == "tool"] == ["total 15"]
    answers = [m["content"] for m in second.messages if m["role"] == "tool"]
    assert answers[:4] == ["total 102", "error: the lookup is down", "error: the tool failed: RuntimeError", "error: no such key"]
    assert answers[4].startswith("error: timed out after 0.5s") and "secret" not in " ".join(answers)
    assert second.info["tool_calls"] == 5 and second.info["tool_errors"] == 4 and second.info["tool_invalid"] == 0
    deadline = time.monotonic() + 5
    while sessions() and time.monotonic() < deadline:  # a linked game's close is fire and forget
        time.sleep(0.05)
    assert sessions() == 0


def test_a_served_call_goes_to_its_session_only():
    served = ServedApp(lambda: create_app(CounterGame))
    try:
        sessions = [httpx.post(f"{served.url}/sessions", json={}).json()["session_id"] for _ in range(2)]
        listed = [httpx.post(f"{served.url}/sessions/{s}/reset", json={"task": {"start": i}}).json()["tools"] for i, s in enumerate(sessions)]
        assert [t["function"]["name"] for t in listed[0]] == ["add", "lookup", "crash", "key", "slow"] and listed[0][4]["timeout_s"] == 0.5
        assert httpx.post(f"{served.url}/sessions/{sessions[1]}/tools/add", json={"arguments": {"n": 7}}).json() == {"content": "total 8"}
        step = httpx.post(f"{served.url}/sessions/{sessions[0]}/step", json={"action": "done"}).json()
        assert step["observation"] == "final 0"
        missing = httpx.post(f"{served.url}/sessions/{sessions[1]}/tools/nope", json={"arguments": {}})
        assert missing.status_code == 404 and "no tool named 'nope'" in missing.json()["detail"]
        assert httpx.post(f"{served.url}/sessions/unknown/tools/add", json={"arguments": {"n": 1}}).status_code == 404
    finally:
        served.stop()


HOSTILE = {
    "bad name": [{"type": "function", "function": {"name": "rm -rf /", "description": "", "parameters": {}}}],
    "too many": [{"type": "function", "function": {"name": f"t{i}", "description": "", "parameters": {}}} for i in range(10_000)],
    "not a dict": [{"type": "function", "function": {"name": "add", "description": "", "parameters": ["n"]}}],
    "not a list": {"add": {}},
    "exponential": [{"type": "function", "function": {"name": "deep", "description": "", "parameters": doubling_chain(28)}}],
}
HOSTILE_REASON = {"bad name": "the name 'rm -rf /' does not match", "too many": "10,000 tools, over the 64 an episode may have",
                  "not a dict": "the parameters are list, not a JSON Schema object", "not a list": "the tool list is dict, not a list",
                  "exponential": "tool 'deep': its parameters schema expands to more than 10,000 subschemas through $ref"}


def _hostile_app():
    """An environment server of a hostile tenant: each episode's tool list is malformed its own way (or fine)."""
    app = FastAPI()
    modes = {}

    @app.post("/sessions")
    def new_session():
        return {"session_id": uuid.uuid4().hex, "system_prompt": "", "initial_user_message": "", "example_turns": []}

    @app.post("/sessions/{session_id}/reset")
    async def reset(session_id: str, request: Request):
        start = (await request.json())["task"]["start"]
        modes[session_id] = list(HOSTILE)[start] if start < len(HOSTILE) else None
        tools = HOSTILE.get(modes[session_id], [{"type": "function", "function": {"name": "echo", "description": "x" * 10_000,
                                                                                 "parameters": {"type": "object"}}}])
        return {"observation": f"The counter starts at {start}.", "system_prompt": "", "initial_user_message": "", "example_turns": [],
                "tools": tools}

    @app.post("/sessions/{session_id}/tools/{name}")
    def call(session_id: str, name: str):
        return {"content": 12345}  # not text

    @app.post("/sessions/{session_id}/step")
    def step(session_id: str):
        return {"observation": "ok", "reward": 1.0, "done": True, "info": {}}

    @app.delete("/sessions/{session_id}")
    def close(session_id: str):
        return {"ok": True}

    return app


def test_a_hostile_servers_tool_list_costs_its_episode_not_the_job(smol):
    served = ServedApp(_hostile_app)
    try:
        game_class = RemoteGameClass(served.url, timeout_s=10, retries=0, max_response_bytes=LIMIT)
        fine = len(HOSTILE)
        trajs, engine = _play(smol, game_class, list(range(fine + 1)),
                              {i: [_call("echo"), "done"] for i in range(fine + 1)})
    finally:
        served.stop()
    for traj, mode in zip(trajs, HOSTILE):
        assert traj.failed and "the episode's tool list is malformed" in traj.failure and HOSTILE_REASON[mode] in traj.failure, traj.failure
    last = trajs[-1]
    assert not last.failed and last.reward == 1.0  # the job went on: the well-listed episode played to its end
    assert [m["content"] for m in last.messages if m["role"] == "tool"] == ["error: the environment's answer to the call has no text"]
    prompt = next(smol.decode(p) for p in engine.prompts if f"starts at {fine}." in smol.decode(p))
    assert "x" * MAX_DESCRIPTION_CHARS in prompt and "x" * (MAX_DESCRIPTION_CHARS + 1) not in prompt  # descriptions are capped


class BadNameGame(CounterGame):
    def get_tools(self):
        return [Tool("no spaces please", "Bad.", lambda a: "")]


@pytest.mark.parametrize("hosted", [("linked", BadNameGame)], indirect=True)
def test_a_linked_games_malformed_tool_list_costs_its_episode(smol, hosted):
    game_class, _ = hosted
    (traj,), _ = _play(smol, game_class, [1], {1: ["done"]})
    assert traj.failed and "the client's game: the episode's tool list is malformed: tool 0: the name 'no spaces please'" in traj.failure


def test_the_wire_rules():
    calls = []
    listing = [{"type": "function", "function": {"name": "a", "parameters": {"type": "object"}}, "timeout_s": 1e9},
               {"type": "function", "function": {"name": "b"}, "timeout_s": 2}]
    a, b = tools_from_listing(listing, lambda *args: calls.append(args) or {"content": "ok"}, max_timeout_s=30)
    assert (a.timeout_s, b.timeout_s) == (31.0, 3.0) and b.parameters == {"type": "object", "properties": {}}
    assert a.run({"x": 1}) == "ok" and calls == [("a", {"x": 1}, 31.0)]
    with pytest.raises(ValueError, match="declared twice"):
        tools_from_listing(listing + listing[:1], lambda *args: {}, 30)
    assert call_reply(Tool("t", "", lambda a: 5), {}) == {"error": "the tool returned int, not text"}
    assert call_reply(Tool("t", "", lambda a: "x"), ["not", "an", "object"]) == {"error": "the arguments are list, not an object"}
