"""A job against an environment served by `opentinker env serve` in another process: it trains
exactly as with the import path, and a server that dies mid-job costs episodes, not the job."""

from __future__ import annotations

import subprocess
import sys
import time

import httpx

from tests.conftest import tiny_spec
from tests.rounding import TINY_LOGPROB, logprob_gap, same_metric
from tests.stack_fixtures import free_ports


def _serve(port: int) -> subprocess.Popen:
    """The server answers only the jobs whose tokens it was given (both jobs of this module)."""
    from opentinker.core.settings import get_settings
    from opentinker.core.tokens import job_token

    tokens = [arg for job in ("served", "served-outage") for arg in ("--token", job_token(get_settings().stack_secret(), job))]
    proc = subprocess.Popen([sys.executable, "-m", "opentinker.cli", "env", "serve", "envs.toy:UppercaseGame", "--port", str(port), *tokens],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).is_success:
                return proc
        except httpx.HTTPError:
            time.sleep(0.2)
    proc.kill()
    raise AssertionError("env server did not start")


def _train(spec, job_id, steps, before_update=None) -> list[dict[str, float]]:
    """`before_update(step)` runs between the step's rollout and its update: the next step's
    episodes start once the update is published (opentinker.rl.producer)."""
    from opentinker.rl import RLJob

    job = RLJob(spec, job_id=job_id)
    history = []
    for step in range(steps):
        metrics = job.rollout(step)
        if before_update:
            before_update(step)
        history.append(metrics | job.update(step))
    job.close()
    return history


def test_served_environment_trains_like_the_import_path_and_survives_a_dead_server(tmp_path):
    (port,) = free_ports(1)
    url = f"http://127.0.0.1:{port}"
    common = {"optimization": {"steps": 5}, "rollout": {"step_timeout_s": 5}}
    local = tiny_spec(tmp_path, **common)
    served = tiny_spec(tmp_path, **common, env={"game": None, "url": url, "config": {"val_size": 16}, "timeout_s": 5, "retries": 1})

    reference = _train(local, "local", 3)
    server = _serve(port)
    try:
        same = _train(served, "served", 3)
        for a, b in zip(reference, same):
            assert a["rollout/reward_mean"] == b["rollout/reward_mean"]
            # the same episodes, their logprobs from decode batches formed at other moments: the loss moves
            # by at most |A|·r ≤ 2 times the logprobs' gap (tests/rounding.py)
            assert same_metric(a["update/policy_loss"], b["update/policy_loss"], 2.0, logprob_gap(TINY_LOGPROB))

        def kill_and_revive(step: int) -> None:  # down while step 1's episodes play, up again for step 2's
            nonlocal server
            if step == 0:
                server.kill()
                server.wait()
            if step == 1:
                server = _serve(port)

        history = _train(served, "served-outage", 3, before_update=kill_and_revive)
    finally:
        server.kill()
    episodes = history[0]["rollout/episodes"]
    assert history[0]["rollout/failed_episodes"] == 0
    assert history[1]["rollout/failed_episodes"] == episodes  # the outage cost that step's episodes ...
    assert history[1]["update/sequences"] == 0
    assert history[2]["rollout/failed_episodes"] == 0  # ... and the job went on once it was back
    assert history[2]["update/sequences"] == episodes
