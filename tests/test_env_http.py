"""Environments served over HTTP behave like the imported class, and their failures cost episodes, not jobs.

Every server here is a real uvicorn on 127.0.0.1, in a background thread of the test process."""

import threading

import httpx
import numpy as np
import pytest
import typer
from typer.testing import CliRunner

from envs.math import MathGame
from opentinker.agent import ChatFormat, EpisodeLimits, run_episodes
from opentinker.backend import HFRolloutEngine, SamplingParams
from opentinker.cli.env import env_app
from opentinker.env import GameEnvironment, environment_from_spec
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
