"""Environments served over HTTP behave like the imported class, and their failures cost episodes, not jobs.

Every server here is a real uvicorn on 127.0.0.1, in a background thread of the test process."""

import asyncio
import gzip
import re
import threading
import time
from typing import Any

import httpx
import numpy as np
import pytest
import typer
from typer.testing import CliRunner

from envs.math import MathGame
from opentinker.agent import ChatFormat, EpisodeLimits, run_episodes
from opentinker.backend import HFRolloutEngine, SamplingParams
from opentinker.cli.env import env_app
from opentinker.env import GameEnvironment, StepResult, environment_from_spec
from opentinker.env.remote import UNAVAILABLE, RemoteGameClass, RemoteGameError
from opentinker.env.server import create_app
from opentinker.tracking.metrics import episode_stats
from opentinker.core.spec import SpecError, parse_spec
from tests.games import NanRewardGame, RaisingGame, ScriptedTurns
from tests.served import ServedApp, free_port

MATH_CONFIG = {"low": 1, "high": 30, "operations": ["+", "-", "*"]}


class Served(ServedApp):
    """One game behind a real server; `stop()` then `start()` restarts it on the same port."""

    def __init__(self, game_class):
        self.game_class = game_class
        super().__init__(lambda: create_app(game_class))

    def sessions(self) -> int:
        return httpx.get(f"{self.url}/health").json()["sessions"]


@pytest.fixture(scope="module")
def math_server():
    served = Served(MathGame)
    yield served
    served.stop()


@pytest.fixture
def scripted_servers():
    pair = [Served(ScriptedTurns), Served(ScriptedTurns)]
    yield pair
    for served in pair:
        if served.thread.is_alive():
            served.stop()


def _spec(**env):
    return parse_spec({"model": {"name": "tiny-random"}, "env": {"config": {**MATH_CONFIG, "val_size": 12}, **env}, "seed": 5})


def test_served_game_plays_like_the_imported_class(math_server):
    remote_cls = RemoteGameClass(math_server.url)
    for seed in (0, 1, 2**40):
        answer = httpx.post(f"{math_server.url}/generate_task", json={"seed": seed, "config": MATH_CONFIG}).json()
        assert answer["task"] == MathGame.generate_task(np.random.default_rng(seed), **MATH_CONFIG)
    rng = np.random.default_rng(9)
    tasks = [MathGame.generate_task(rng, **MATH_CONFIG) for _ in range(5)]
    for kwargs in ({}, {"few_shot": 3, "format_reward": 0.25}):
        for task in tasks:
            local, remote = MathGame(**kwargs), remote_cls(**kwargs)
            assert remote.reset(**task) == local.reset(**task)
            assert remote.get_system_prompt() == local.get_system_prompt()
            assert remote.get_initial_user_message() == local.get_initial_user_message()
            assert remote.get_example_turns() == local.get_example_turns()
            for action in (f"Answer: {task['answer']}", "Answer: -999", "no idea"):
                assert remote.step(action) == local.step(action)
            remote.close()
    assert math_server.sessions() == 0
    assert "RemoteGame(http://127.0.0.1" in repr(GameEnvironment(remote_cls, {"val_size": 2}))


def test_url_spec_draws_the_same_tasks_as_the_game_spec(math_server):
    by_class = environment_from_spec(_spec(game="envs.math:MathGame"))
    by_url = environment_from_spec(_spec(url=math_server.url, timeout_s=5, retries=1))
    assert by_url.validation_tasks() == by_class.validation_tasks() and len(by_url.validation_tasks()) == 12
    assert by_url.train_tasks(30) == by_class.train_tasks(30)
    assert by_url.state() == by_class.state()  # checkpoints resume the same stream either way


def test_sixteen_concurrent_episodes(math_server):
    remote_cls = RemoteGameClass([math_server.url])
    rng = np.random.default_rng(3)
    tasks = [MathGame.generate_task(rng, **MATH_CONFIG) for _ in range(16)]
    results = [None] * 16

    def play(i: int) -> None:
        game = remote_cls()
        game.reset(**tasks[i])
        results[i] = game.step(f"Answer: {tasks[i]['answer'] + i % 2}")
        game.close()

    threads = [threading.Thread(target=play, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert [r.reward for r in results] == [1.0 - i % 2 for i in range(16)]
    assert math_server.sessions() == 0


def test_two_shards_behind_one_spec_are_both_used(scripted_servers):
    a, b = scripted_servers
    spec = parse_spec({"model": {"name": "tiny-random"}, "env": {"url": [a.url, b.url], "config": {"dataset": [{"id": i} for i in range(8)]}}})
    env = environment_from_spec(spec)
    games = [env.make_game() for _ in range(6)]
    for game, task in zip(games, env.train_tasks(6)):
        assert game.reset(**task) == f"start {task['id']}"
    assert (a.sessions(), b.sessions()) == (3, 3)
    for game in games:
        game.close()
    assert (a.sessions(), b.sessions()) == (0, 0)


class StopsServerOnceAllStarted:
    """The real engine; the given server goes down once all `episodes` have reset and asked for
    their first turn, before any is generated: no episode can play a turn on it first (episodes
    play in threads of their own, and a stop takes up to uvicorn's 0.1 s poll)."""

    def __init__(self, inner, served, episodes: int):
        self.inner = inner
        self.stopped = threading.Event()
        self.all_started = threading.Barrier(episodes, action=lambda: (served.stop(), self.stopped.set()))

    @property
    def policy_version(self):
        return self.inner.policy_version

    def generate(self, prompts, params, budgets=None, **_):
        if not self.stopped.is_set():
            self.all_started.wait(timeout=30)
        return self.inner.generate(prompts, params, budgets)


def test_a_server_stopped_mid_episode_fails_only_its_episodes(tiny, scripted_servers):
    model, tok = tiny
    a, b = scripted_servers
    chat, params = ChatFormat(tok), SamplingParams(max_new_tokens=3)
    limits = EpisodeLimits(max_turns=5, max_total_tokens=512, step_timeout_s=10)
    remote_cls = RemoteGameClass([a.url, b.url], timeout_s=5, retries=1)
    engine = StopsServerOnceAllStarted(HFRolloutEngine(model, tok), b, episodes=4)
    games = [remote_cls() for _ in range(4)]  # shards a, b, a, b
    trajs = run_episodes(engine, chat, games, [{"id": i} for i in range(4)], params, limits)
    assert [t.failed for t in trajs] == [False, True, False, True]
    assert all(len(t.turns) == 3 and t.reward == pytest.approx(1.3) for t in trajs[::2])
    assert trajs[1].failure.startswith(f"step: ShardUnreachable: POST {b.url}/sessions/") and "ConnectError" in trajs[1].failure
    assert episode_stats(trajs, "rollout")["rollout/failed_episodes"] == 2.0

    # while b is down: a game made for it fails at reset, and a task it cannot draw fails its episode
    only_b = RemoteGameClass(b.url, timeout_s=5, retries=0)
    sentinel = only_b.generate_task(np.random.default_rng(0))
    assert sentinel[UNAVAILABLE].startswith(f"no shard answered at {b.url}")
    trajs = run_episodes(engine, chat, [only_b(), remote_cls()], [{"id": 0}, sentinel], params, limits)
    assert [t.failed for t in trajs] == [True, True]
    assert "ConnectError" in trajs[0].failure and trajs[1].failure.startswith("reset: RemoteGameError: no task for this episode")
    with pytest.raises(RuntimeError, match=f"env.url: no shard answered at {b.url}"):
        environment_from_spec(parse_spec({"model": {"name": "tiny-random"}, "env": {"url": b.url, "retries": 0, "config": {"val_size": 4}}}))

    b.start()  # the same port again
    trajs = run_episodes(engine, chat, [remote_cls() for _ in range(4)], [{"id": i} for i in range(4)], params, limits)
    assert not any(t.failed for t in trajs) and a.sessions() == b.sessions() == 0


def test_game_errors_are_http_errors_and_the_server_lives_on():
    served = Served(RaisingGame)
    try:
        url = served.url
        assert httpx.post(f"{url}/sessions/nope/step", json={"action": "x"}).status_code == 404
        assert httpx.delete(f"{url}/sessions/nope").status_code == 404
        session = httpx.post(f"{url}/sessions", json={}).json()["session_id"]
        assert httpx.post(f"{url}/sessions/{session}/reset", json={"task": {"id": 1}}).json()["observation"] == "start 1"
        assert httpx.post(f"{url}/sessions/{session}/step", json={}).status_code == 422
        failed = httpx.post(f"{url}/sessions/{session}/step", json={"action": "x"})
        assert failed.status_code == 500 and failed.json() == {"detail": "RuntimeError: environment bug"}
        bad_kwargs = httpx.post(f"{url}/sessions", json={"game_kwargs": {"colour": 1}})
        assert bad_kwargs.status_code == 500 and bad_kwargs.json()["detail"].startswith("TypeError:")
        no_generator = httpx.post(f"{url}/generate_task", json={"seed": 1})  # a data-free game: a seed task
        assert no_generator.status_code == 200 and set(no_generator.json()["task"]) == {"__seed__"}
        assert httpx.post(f"{url}/generate_task", json={"config": {}}).status_code == 422  # neither seed nor rng_state
        assert httpx.get(f"{url}/health").json() == {"ok": True, "game": "RaisingGame", "sessions": 1}

        game = RemoteGameClass(url)()
        game.reset()
        with pytest.raises(RemoteGameError, match=r"HTTP 500: RuntimeError: environment bug"):
            game.step("x")
        served_env = GameEnvironment(RemoteGameClass(url), {"val_size": 2})  # data-free: seed tasks drawn by the server
        assert len({t["__seed__"] for t in served_env.validation_tasks()}) == 2
    finally:
        served.stop()
    nan = Served(NanRewardGame)
    try:
        game = RemoteGameClass(nan.url)()
        game.reset()
        with pytest.raises(RemoteGameError, match="HTTP 500: ValueError: Out of range float"):
            game.step("x")
        assert httpx.get(f"{nan.url}/health").json()["ok"]
    finally:
        nan.stop()


def _spec_error(env) -> str:
    with pytest.raises(SpecError) as info:
        parse_spec({"model": {"name": "tiny-random"}, "env": env})
    return str(info.value)


def test_env_spec_needs_exactly_one_of_game_and_url():
    both = _spec_error({"game": "envs.math:MathGame", "url": "http://localhost:8300"})
    assert both.startswith("env: give exactly one of env.game") and "env.url" in both
    assert _spec_error({}).startswith("env: give exactly one of env.game")
    assert _spec_error({"url": "localhost:8300"}).startswith("env.url: 'localhost:8300' must start with http:// or https://")
    assert "env.url" in _spec_error({"url": ["http://a:1", "ftp://b:2"]})
    assert "env.url: give at least one URL" in _spec_error({"url": []})
    assert "env.retries" in _spec_error({"url": "http://a:1", "retries": -1})
    spec = parse_spec({"model": {"name": "tiny-random"}, "env": {"url": ["http://a:1/", "https://b:2"]}})
    assert spec.env.urls == ["http://a:1/", "https://b:2"] and spec.env.label == "http://a:1/, https://b:2"
    assert parse_spec({"model": {"name": "tiny-random"}, "env": {"game": "envs.math:MathGame"}}).env.label == "envs.math:MathGame"


def test_cli_serve_with_a_bad_import_path_says_so_in_one_line():
    root = typer.Typer()
    root.add_typer(env_app, name="env")
    for path in ("envs.nope:X", "envs.math:NoSuchGame", "envs.math", "envs.math.game:parse_answer"):
        result = CliRunner().invoke(root, ["env", "serve", path, "--port", str(free_port())])
        assert result.exit_code == 2, result.output
        assert result.output.startswith(f"cannot serve {path}:") and len(result.output.strip().splitlines()) == 1


# --- what a server sends is bounded (OPENTINKER_ENV_MAX_RESPONSE_BYTES) ---------------------------

MiB = 1024**2
LIMIT_LINE = r"the answer is over the limit of OPENTINKER_ENV_MAX_RESPONSE_BYTES \(1,048,576 bytes\): "


class BulkyOnEvenTasks(ScriptedTurns):
    """One turn; the step of a task with an even id answers a 3 MB observation."""

    def reset(self, **task: Any) -> str:
        self.bulky = task.get("id", 0) % 2 == 0
        return super().reset(**task)

    def step(self, action: str) -> StepResult:
        return StepResult(observation="x" * 3 * MiB if self.bulky else "fine", reward=0.0 if self.bulky else 1.0, done=True)


class Streams:
    """A server whose every answer is `body(request)` as a chunked stream (no Content-Length),
    with `headers`; `stopped` is set once a stream has ended (finished or cut off by the client)."""

    def __init__(self, body, headers=None):
        from starlette.applications import Starlette
        from starlette.responses import StreamingResponse
        from starlette.routing import Route

        self.stopped = threading.Event()

        async def answer(request):
            async def stream():
                try:
                    async for chunk in body(request):
                        yield chunk
                finally:
                    self.stopped.set()

            if request.method == "POST" and request.url.path == "/sessions":  # sessions open normally
                return StreamingResponse(iter([b'{"session_id": "s1", "system_prompt": "", "initial_user_message": "", "example_turns": []}']))
            return StreamingResponse(stream(), headers=headers, media_type="application/json")

        self.served = ServedApp(lambda: Starlette(routes=[Route("/{path:path}", answer, methods=["GET", "POST", "DELETE"])]))
        self.url = self.served.url


async def _endless(request):
    chunk = b"x" * 65536
    while True:
        yield chunk
        await asyncio.sleep(0)


async def _trickle(request):
    for _ in range(1000):
        yield b" "
        await asyncio.sleep(0.1)


async def _gzipped(request):
    yield gzip.compress(b'{"observation": "' + b"x" * 50 * MiB + b'"}')


def test_an_answer_over_the_limit_costs_its_episode_in_one_line_and_the_rest_is_never_read():
    bulky = Served(BulkyOnEvenTasks)
    try:  # announced: refused from its Content-Length, before a byte of it is read
        remote_cls = RemoteGameClass(bulky.url, max_response_bytes=MiB)
        game = remote_cls()
        assert game.reset(id=0) == "start 0"
        with pytest.raises(RemoteGameError) as refused:
            game.step("anything")
        assert re.fullmatch(rf"POST {bulky.url}/sessions/…/step: {LIMIT_LINE}3,145,7\d\d bytes announced \(Content-Length\)", str(refused.value))
        game.close()
        game = remote_cls()  # the server and the client's pool go on
        game.reset(id=1)
        assert game.step("anything").observation == "fine"
        game.close()
    finally:
        bulky.stop()

    endless = Streams(_endless)  # streamed, never ending: counted, cut at the limit, the connection closed
    try:
        game = RemoteGameClass(endless.url, timeout_s=30, max_response_bytes=MiB)()
        started = time.monotonic()
        with pytest.raises(RemoteGameError, match=rf"^POST {endless.url}/sessions/…/reset: {LIMIT_LINE}1,\d{{3}},\d{{3}} bytes read and more coming$"):
            game.reset()
        assert time.monotonic() - started < 5 and endless.stopped.wait(5)  # the server saw the client go
        sentinel = RemoteGameClass(endless.url, max_response_bytes=MiB).generate_task(np.random.default_rng(0))
        assert re.fullmatch(rf"no task from {endless.url} \(POST {endless.url}/generate_task: {LIMIT_LINE}.* bytes read and more coming\)",
                            sentinel[UNAVAILABLE])  # a task too large to read costs its episodes, never the job
    finally:
        endless.served.stop()

    trickle = Streams(_trickle)  # a byte every 0.1 s keeps each read alive: the whole answer has timeout_s
    try:
        game = RemoteGameClass(trickle.url, timeout_s=1, max_response_bytes=MiB)()
        started = time.monotonic()
        with pytest.raises(RemoteGameError, match=r"^POST .*/sessions/…/reset: the answer was not complete in time \(\d+ bytes read\)$"):
            game.reset()
        assert time.monotonic() - started < 3
    finally:
        trickle.served.stop()

    gzipped = Streams(_gzipped, headers={"Content-Encoding": "gzip"})  # 50 KB on the wire, 50 MB inflated: never inflated
    try:
        with pytest.raises(RemoteGameError, match=r"/sessions/…/reset: the answer is compressed \(Content-Encoding: gzip\), which the job does not accept$"):
            RemoteGameClass(gzipped.url, max_response_bytes=MiB)().reset()
    finally:
        gzipped.served.stop()


def test_the_same_failure_of_every_episode_reads_as_one(tiny, caplog):
    """The reason names the route, not the session: eight episodes failing alike read "8 of 8"; the
    log keeps each session's full URL."""
    model, tok = tiny
    served = Served(RaisingGame)
    try:
        remote_cls = RemoteGameClass(served.url, timeout_s=5)
        with caplog.at_level("WARNING", logger="opentinker.env.remote"):
            trajs = run_episodes(HFRolloutEngine(model, tok), ChatFormat(tok), [remote_cls() for _ in range(8)], [{"id": i} for i in range(8)],
                                 SamplingParams(max_new_tokens=3), EpisodeLimits(max_turns=2, max_total_tokens=512, step_timeout_s=10))
    finally:
        served.stop()
    reason = f"step: RemoteGameError: POST {served.url}/sessions/…/step: HTTP 500: RuntimeError: environment bug"
    assert episode_stats(trajs, "rollout")["rollout/first_failure"] == f"{reason} (8 of 8 episodes)"
    logged = {m for m in caplog.messages if "/step: HTTP 500" in m}
    assert len(logged) == 8 and all(re.fullmatch(rf"POST {served.url}/sessions/[0-9a-f]{{32}}/step: HTTP 500: RuntimeError: environment bug", m) for m in logged)  # one per session


def test_a_job_whose_server_answers_too_much_fails_those_episodes_and_goes_on(tmp_path, monkeypatch):
    """In-process RLJob against a real server: half the tasks' steps answer 3 MB over a 1 MiB limit
    (two training tasks, four a step: each step plays both twice)."""
    from opentinker.rl import RLJob
    from tests.conftest import tiny_spec

    monkeypatch.setenv("OPENTINKER_ENV_MAX_RESPONSE_BYTES", str(MiB))
    served = Served(BulkyOnEvenTasks)
    try:
        spec = tiny_spec(tmp_path, optimization={"steps": 3}, evaluation={"every": 0, "n_samples": 4}, checkpoint={"every": 3},
                         env={"game": None, "url": served.url, "timeout_s": 10, "config": {"dataset": [{"id": 0}, {"id": 1}], "val_dataset": [{"id": 2}, {"id": 3}]}})
        seen = []
        result = RLJob(spec, job_id="bulky").run(on_step=seen.append)
    finally:
        served.stop()
    assert result.steps_done == 3 and result.not_registrable is None  # the job went on, healthy
    for report in seen:
        assert report.metrics["rollout/failed_episodes"] == 8 and report.metrics["update/sequences"] == 8
        assert re.fullmatch(rf"step: AnswerRefused: POST {served.url}/sessions/…/step: {LIMIT_LINE}3,145,7\d\d bytes announced "
                            r"\(Content-Length\) \(8 of 16 episodes\)", report.metrics["rollout/first_failure"])
