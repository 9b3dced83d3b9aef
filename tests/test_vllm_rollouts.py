"""Rollouts through a real vLLM server (`rollout.engine: vllm`), on this CPU: a multi-turn record is
token-exact, with float32 logprobs within 1e-4 of the trainer's recompute; a job's update reaches
the server as merged weights and shows in the next samples; a killed server fails the job in one
line and the same job id resumes from its checkpoint with a new server; start-up failures read as
one line. Skipped, with the reason, where vLLM cannot run (tests/vllm_fixtures.py)."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import tempfile
from pathlib import Path

import httpx
import psutil
import pytest
import torch

from tests.conftest import tiny_spec

TOLERANCE = 1e-4  # float32 on the CPU: vLLM's kernels against transformers' (measured 3.2e-5 on SmolLM2)


def _scored(model, traj) -> float:
    """The largest |sampled logprob - the trainer's recompute| over a record's sampled tokens."""
    from opentinker.backend.device import cpu
    from opentinker.backend.rollout import score_tokens

    worst = 0.0
    ids = traj.token_ids
    for start, end in _spans(traj.loss_mask):
        again = score_tokens(model, cpu(), ids[:start], ids[start:end])
        worst = max(worst, *(abs(a - b) for a, b in zip(again, traj.sampling_logprobs[start:end])))
    return worst


def _spans(mask: list[int]) -> list[tuple[int, int]]:
    spans, start = [], None
    for i, m in enumerate([*mask, 0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            spans.append((start, i))
            start = None
    return spans


def test_a_multi_turn_record_through_vllm_is_token_exact(vllm_pool, vllm_tiny_path):
    """Three turns of a scripted game, sampled by vLLM with the policy's merged weights: the
    record is the prompt, then each turn's sampled tokens (mask 1, vLLM's logprobs within 1e-4 of
    the recompute) and the observation's tokens (mask 0), appended, never re-tokenized."""
    from opentinker.agent import EpisodeLimits, chat_format, run_episodes
    from opentinker.backend import SamplingParams
    from opentinker.backend.device import cpu
    from opentinker.backend.rollout import score_tokens
    from opentinker.backend.server_engine import Probe, ServerHandle, ServerRolloutEngine
    from opentinker.core.spec import LoraSpec
    from opentinker.model import load_model, wrap_model
    from opentinker.model.adapters import lora_factors
    from tests.games import ScriptedTurns

    server = vllm_pool.get(vllm_tiny_path, "merged")
    base, tok = load_model(vllm_tiny_path)
    model = wrap_model(base, LoraSpec(r=8, alpha=16))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(1)) * 0.3)
    engine = ServerRolloutEngine(server.handle("merged", owned=False), TOLERANCE)
    engine.sync_weights(0, lora_factors(model), Probe(tok("a probe")["input_ids"], lambda p, t: score_tokens(model, cpu(), p, t))).result()
    chat = chat_format(tok)
    try:
        trajs = run_episodes(engine, chat, [ScriptedTurns(turns=3) for _ in range(4)], [{"id": i} for i in range(4)],
                             SamplingParams(max_new_tokens=6), EpisodeLimits(max_turns=3, max_total_tokens=512))
    finally:
        engine.close()
    assert "Failed to load weights" not in server.log.read_text()  # the in-place reload's false alarms (vllm_worker.py)
    for t in trajs:
        assert not t.failed and len(t.turns) == 3 and t.stop_reason == "done"
        spans = _spans(t.loss_mask)
        assert len(spans) == 3 and spans[0][0] == len(t.prompt_ids) and t.token_ids[: len(t.prompt_ids)] == t.prompt_ids
        for (start, end), turn in zip(spans, t.turns):
            assert t.token_ids[start:end] == t.token_ids[turn.sampled_start:turn.sampled_end]
        for k, ((_, end), (nxt, _)) in enumerate(zip(spans, spans[1:])):  # between two turns: the observation, not trained
            assert set(t.loss_mask[end:nxt]) == {0} and t.turns[k].observation in tok.decode(t.token_ids[end:nxt])
        assert _scored(model, t) < TOLERANCE


@pytest.mark.parametrize("adapter", [{"kind": "lora", "r": 8, "alpha": 16}, {"kind": "full"}], ids=["lora", "full"])
def test_a_job_samples_through_vllm_and_each_update_shows_in_the_next_samples(vllm_pool, vllm_tiny_path, tmp_path, adapter):
    """Three steps of a job on a vLLM server taking its weights in place, a LoRA's factors merged or
    a full fine-tune's weights (the tiny model's output layer is tied to the embedding it trains):
    each step samples the version the trainer is at (the probe within tolerance), and the tokens it
    trains on score within 1e-4 of the trainer's recompute of that version."""
    from opentinker.backend.server_engine import ServerHandle
    from opentinker.rl import RLJob

    server = vllm_pool.get(vllm_tiny_path, "merged")
    spec = tiny_spec(tmp_path, model={"name": vllm_tiny_path}, rollout={"engine": "vllm", "prompts_per_step": 2, "group_size": 4, "max_new_tokens": 6},
                     optimization={"steps": 3, "lr": 5e-2 if adapter["kind"] == "lora" else 1e-2}, adapter=adapter)
    job = RLJob(spec, job_id=f"through-vllm-{adapter['kind']}", start_server=lambda *_: server.handle("merged", owned=False))
    gaps, versions = [], []
    original = job.policy.update

    def update(batch):
        gaps.append(max(_scored(job.policy.model, t) for t in batch.trajectories if t.num_sampled))
        versions.append({v for t in batch.trajectories for v, m in zip(t.token_versions, t.loss_mask) if m})
        return original(batch)

    job.policy.update = update
    try:
        result = job.run()
    finally:
        job.close()
    assert result.steps_done == 3
    assert versions == [{0}, {1}, {2}] and max(gaps) < TOLERANCE, gaps
    assert all(h["rollout/sync_logprob_gap"] <= 1e-3 and h["rollout/policy_version"] == h["step"] - 1 for h in result.history)


def test_weights_taken_in_place_but_not_the_trainers_fail_the_step_before_its_update(vllm_pool, vllm_tiny_path, tmp_path, monkeypatch):
    """The server takes every reload, but from version 1 on it is sent version 0's factors again: the
    probe, which runs beside the episodes the reload serves, fails the step in one line before the
    update trains on a single one of them."""
    from opentinker.backend.server_engine import ServerHandle, SyncError
    from opentinker.model.adapters import lora_factors
    from opentinker.rl import RLJob
    from opentinker.rl import sampler as sampler_module

    first: dict[str, dict] = {}
    monkeypatch.setattr(sampler_module, "lora_factors", lambda model: first.setdefault("v0", lora_factors(model)))
    server = vllm_pool.get(vllm_tiny_path, "merged")
    spec = tiny_spec(tmp_path, model={"name": vllm_tiny_path}, rollout={"engine": "vllm", "prompts_per_step": 2, "group_size": 4, "max_new_tokens": 6},
                     optimization={"steps": 3, "lr": 5e-2}, adapter={"kind": "lora", "r": 8, "alpha": 16})
    job = RLJob(spec, job_id="stale-in-place", start_server=lambda *_: server.handle("merged", owned=False))
    trained, original = [], job.policy.update
    job.policy.update = lambda batch: (trained.append(batch.step), original(batch))[1]
    try:
        with pytest.raises(SyncError, match=r"away from the trainer's version 1, over the tolerance"):
            job.run()
    finally:
        job.close()
    assert trained == [0]  # step 0 (version 0) trained; step 1, drawn by other weights than version 1, never


def test_a_bfloat16_sampler_under_a_float32_trainer_is_corrected_by_decoupled_ppo(vllm_pool, vllm_tiny_path, tmp_path):
    """rollout.sampler_dtype bfloat16: the server samples in bfloat16 (its tokens' logprobs are not the
    trainer's float32 ones), the sync probe allows bfloat16's gap, and the update weighs each token by
    the capped pi_trainer / pi_sampler at k = 0 (the weight's metrics are logged)."""
    from opentinker.backend.server_engine import ServerHandle
    from opentinker.rl import RLJob

    server = vllm_pool.get(vllm_tiny_path, "merged", dtype="bfloat16")
    spec = tiny_spec(tmp_path, model={"name": vllm_tiny_path}, adapter={"kind": "lora", "r": 8, "alpha": 16},
                     rollout={"engine": "vllm", "sampler_dtype": "bfloat16", "prompts_per_step": 2, "group_size": 4, "max_new_tokens": 6},
                     optimization={"steps": 2, "lr": 5e-2})
    job = RLJob(spec, job_id="bf16-sampler", start_server=lambda *_: server.handle("merged", owned=False))
    gaps = []
    original = job.policy.update

    def update(batch):
        gaps.append(max(_scored(job.policy.model, t) for t in batch.trajectories if t.num_sampled))
        return original(batch)

    job.policy.update = update
    try:
        assert job.policy.trainer.off_policy and spec.algorithm.max_staleness == 0
        result = job.run()
    finally:
        job.close()
    assert result.steps_done == 2 and min(gaps) > TOLERANCE, gaps  # bfloat16's numbers, not float32's
    for h in result.history:
        assert 0 < h["update/behaviour_weight_mean"] <= spec.algorithm.importance_cap and 0 < h["rollout/sync_logprob_gap"] <= 0.1


def test_k_2_through_vllm_updates_land_while_episodes_run(vllm_pool, vllm_tiny_path, tmp_path):
    """max_staleness 2 through vLLM: the producer plays ahead while the trainer updates, each update
    is merged into the server's weights between its steps while requests run on (no wait for them);
    every trained token records a version at most 2 behind (a request records the version it started
    on: tokens drawn after an update in flight are newer than they say, never older; the trainer
    refuses more than 2), and the update weighs them by decoupled PPO."""
    from opentinker.backend.server_engine import ServerHandle
    from opentinker.rl import RLJob

    server = vllm_pool.get(vllm_tiny_path, "merged")
    spec = tiny_spec(tmp_path, model={"name": vllm_tiny_path}, adapter={"kind": "lora", "r": 8, "alpha": 16}, algorithm={"max_staleness": 2},
                     rollout={"engine": "vllm", "prompts_per_step": 2, "group_size": 4, "max_new_tokens": 6}, optimization={"steps": 4, "lr": 5e-2})
    job = RLJob(spec, job_id="k2-through-vllm", start_server=lambda *_: server.handle("merged", owned=False))
    try:
        result = job.run()
    finally:
        job.close()
    assert result.steps_done == 4
    for h in result.history:
        assert h["rollout/version_lag_max"] <= 2 and 0 < h["update/behaviour_weight_mean"] <= spec.algorithm.importance_cap
    assert sum(h["rollout/groups_dropped"] for h in result.history) == 0


def _reuse_rounds(server, gaps: list[float]) -> tuple[int, int]:
    """Rounds of 32 concurrent requests through a job's engine, idle `gaps` seconds apart: (requests
    answered, transport faults retried)."""
    import time

    from opentinker.backend import SamplingParams
    from opentinker.backend.server_engine import ServerRolloutEngine

    engine = ServerRolloutEngine(server.handle("merged", owned=False), TOLERANCE)
    answered = 0
    try:
        for gap in [0.0, *gaps]:
            time.sleep(gap)
            generators = [torch.Generator().manual_seed(i) for i in range(32)]  # one request each
            done = engine.generate([[1, 2, 3, i] for i in range(32)], SamplingParams(max_new_tokens=2), generators=generators)
            answered += len(done)
        pooled = len(engine.client._transport._pool.connections)
    finally:
        engine.close()
    assert pooled <= 32  # the rounds reused the first round's connections
    return answered, engine.calls.retried


def test_a_jobs_server_keeps_its_connections_across_a_steps_idle_gap(vllm_pool, vllm_tiny_path):
    """A step leaves its server idle for its update and sync (4.5-5.5 s in `make demo`, where both
    sides' keep-alive was 5 s and pooled connections failed in transport). Idle gaps around that and
    past it: every reused connection answers, none needed a retry."""
    server = vllm_pool.get(vllm_tiny_path, "merged")
    answered, retried = _reuse_rounds(server, [4.9, 5.1, 6.0])
    assert (answered, retried) == (128, 0)


@pytest.mark.slow  # 16 idle gaps of about 5 s
def test_500_reuses_around_the_old_keep_alive_need_no_retry(vllm_pool, vllm_tiny_path):
    server = vllm_pool.get(vllm_tiny_path, "merged")
    answered, retried = _reuse_rounds(server, [4.9 + 0.2 * (i % 3) for i in range(16)])
    assert (answered, retried) == (32 * 17, 0)


def test_a_paused_server_is_noticed_within_seconds_and_past_the_limit_fails_the_job(vllm_pool, vllm_tiny_path, caplog):
    """Someone holding the job's key pauses its vLLM server: the job's requests wait, the engine
    notices within seconds (a warning, `rollout/server_stalled_seconds`), and past its limit lets
    them go (resumes the server) and fails with a line that says the server was paused."""
    import logging
    import threading

    from opentinker.backend import SamplingParams
    from opentinker.backend.server_engine import ServerRolloutEngine, ServerStalled

    server = vllm_pool.get(vllm_tiny_path, "merged")
    owner = {"Authorization": f"Bearer {server.api_key}"}
    engine = ServerRolloutEngine(server.handle("merged", owned=False), TOLERANCE, stall_notice_s=2.0, stall_limit_s=6.0)
    outcome: list[BaseException | None] = []
    try:
        assert httpx.post(f"{server.url}/pause", headers=owner, timeout=30, trust_env=False).status_code == 200
        caplog.set_level(logging.WARNING, "opentinker.backend.server_engine")

        def sample() -> None:
            try:
                engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=4, greedy=True))
                outcome.append(None)
            except BaseException as err:  # noqa: BLE001 - what the step would raise
                outcome.append(err)

        worker = threading.Thread(target=sample)
        worker.start()
        worker.join(timeout=5.0)
        assert worker.is_alive() and engine.server_metrics()["rollout/server_stalled_seconds"] >= 1
        assert any("is paused: the job's requests have had no answer" in r.getMessage() for r in caplog.records)
        worker.join(timeout=60)
        assert len(outcome) == 1 and isinstance(outcome[0], ServerStalled), outcome
        assert re.match(r"^the inference server at \S+ was paused under the job's requests for \d+ s \(over 6 s\): "
                        r"someone holding its key stopped it$", str(outcome[0]))
    finally:
        engine.close()
        httpx.post(f"{server.url}/resume", headers=owner, timeout=30, trust_env=False)
    assert httpx.get(f"{server.url}/is_paused", headers=owner, timeout=30, trust_env=False).json() == {"is_paused": False}


def test_a_server_that_dies_says_how_in_its_log(vllm_pool, vllm_tiny_path):
    """The server's own process killed (not its group): its supervisor writes the signal into the
    log, which `why` returns (vLLM itself logs no error then), and `stop` clears what is left. The
    module's last use of the session's merged server (the tests after it start their own)."""
    from opentinker.inference.engine_vllm import SERVER_MODULE

    server = vllm_pool.get(vllm_tiny_path, "merged")
    group = os.getpgid(server._process.pid)
    try:
        (api,) = [c for c in psutil.Process(server._process.pid).children() if c.cmdline()[1:3] == ["-m", SERVER_MODULE]]  # not the watcher
        api.send_signal(signal.SIGKILL)
        server._process.wait(timeout=30)
        assert server.why() == "vLLM's server was ended by signal SIGKILL"
    finally:
        vllm_pool.discard(vllm_tiny_path, "merged")  # stops what is left of it
    from opentinker.core.polling import wait_for

    wait_for(lambda: not [p for p in psutil.process_iter() if _live_in(p, group)] or None, interval=0.2, timeout=15.0,
             what="the server's process group to go")


def test_how_a_server_ended_is_read_from_its_log(tmp_path):
    """`why` on logs as the supervisor leaves them (no vLLM needed): a signal or the supervisor's kill
    is the cause even after an error the server logged and lived on (a request it refused); an exit
    of its own is explained by its last error."""
    from types import SimpleNamespace

    from opentinker.inference.engine_vllm import VLLMServer

    refused = "ERROR 12-03 [serving.py:1] ValueError: this server loads weights only from its job's own folder\n"
    cases = {refused + "\n[opentinker] supervisor: vLLM's server was ended by signal SIGKILL\n": "vLLM's server was ended by signal SIGKILL",
             refused + "\n[opentinker] supervisor: SIGTERM from pid 7 (kill 9; the starter is 3): the server's process group is killed\n":
                 "SIGTERM from pid 7 (kill 9; the starter is 3): the server's process group is killed",
             refused + "\n[opentinker] supervisor: vLLM's server exited with code 1\n":
                 "ValueError: this server loads weights only from its job's own folder",
             "\n[opentinker] supervisor: vLLM's server exited with code 0\n": "vLLM's server exited with code 0"}
    for text, cause in cases.items():
        (tmp_path / "vllm.log").write_text(text)
        assert VLLMServer.why(SimpleNamespace(log=tmp_path / "vllm.log", port=1, host="127.0.0.1")) == cause, text


def _vllm_servers_of_this_process(pool) -> list[psutil.Process]:
    """vLLM's server processes under this one (not their supervisors, which run `python -c`), but for
    the session's pool's."""
    spared = {os.getpgid(server._process.pid) for server in pool.running.values()}
    return [p for p in psutil.Process().children(recursive=True)
            if p.cmdline()[1:3] == ["-m", "vllm.entrypoints.openai.api_server"] and os.getpgid(p.pid) not in spared]


def _vllm_processes() -> set[int]:
    """Every vLLM process on this machine: servers, supervisors and engine cores (which rename themselves)."""
    found = set()
    for p in psutil.process_iter(["name", "cmdline"]):
        if (p.info["name"] or "").startswith("VLLM") or "vllm.entrypoints" in " ".join(p.info["cmdline"] or []):
            found.add(p.pid)
    return found


def _killer(steps: set[int], killed: list[int], listening: list, pool):
    """An on_step hook: SIGKILL to this process's vLLM servers (the pool's spared) after each of
    `steps` (once each), noting any TCP port they listened on."""
    def hook(report) -> None:
        if report.step in steps and report.step not in killed:
            killed.append(report.step)
            for process in _vllm_servers_of_this_process(pool):
                listening.extend(c for c in process.net_connections("inet") if c.status == psutil.CONN_LISTEN)
                os.killpg(os.getpgid(process.pid), signal.SIGKILL)
    return hook


def test_a_killed_vllm_server_is_started_again_once(vllm_pool, vllm_tiny_path, tmp_path):
    """The job samples through two vLLM servers of its own (the product's path: each on a Unix socket,
    no port), sharing the requests and each taking every update in place, verified. SIGKILL to the
    second after step 1's checkpoint: the job's line names it, a new one takes its place while the
    first lives on, and the job goes on from step 1 and completes."""
    from opentinker.inference.launch import rollout_server
    from opentinker.rl import RLJob

    vllm_pool.room(servers=2)  # memory for the job's own servers
    spec = tiny_spec(tmp_path, model={"name": vllm_tiny_path}, optimization={"steps": 3}, checkpoint={"every": 1},
                     rollout={"engine": "vllm", "servers": 2, "prompts_per_step": 2, "group_size": 2, "max_new_tokens": 4})
    killed: list[int] = []
    listening: list = []  # a job's own server listens on a Unix socket in its folder, on no port
    once = RLJob(spec, job_id="killed-once", start_server=rollout_server)
    pool = once.sampler.engine
    first, second = (m.server.uds for m in pool.members)

    def kill_the_second(report) -> None:
        if report.step == 1 and not killed:
            killed.append(report.step)
            for process in _vllm_servers_of_this_process(vllm_pool):
                listening.extend(c for c in process.net_connections("inet") if c.status == psutil.CONN_LISTEN)
                if second in process.cmdline():
                    os.killpg(os.getpgid(process.pid), signal.SIGKILL)
    try:
        result = once.run(on_step=kill_the_second)
    finally:
        once.close()
    assert (result.steps_done, killed, listening) == (3, [1], [])
    assert re.match(r"^inference server 2 of 2 at unix:\S+ is gone: vLLM's server ended", result.restarted), result.restarted
    assert pool.members[0].server.uds == first and pool.members[1].server.uds != second  # only the dead one started again
    assert [m.synced_version for m in pool.members] == [3, 3] and all(n > 0 for n in pool.requests)
    assert [h["step"] for h in result.history] == [1.0, 2.0, 3.0]  # step 2 trained once, after the restart


@pytest.mark.slow  # two more vLLM starts (~40 s); a server that dies failing the job in one line is in the default run
def test_a_vllm_server_killed_twice_fails_the_job_in_one_line(vllm_pool, vllm_tiny_path, tmp_path):
    """Killed after step 1 and again after step 2: the second death fails the job in one line
    saying how the server ended, with step 2's checkpoint there to resume from."""
    from opentinker.backend.server_engine import ServerGone
    from opentinker.inference.launch import rollout_server
    from opentinker.rl import RLJob

    vllm_pool.room()
    spec = tiny_spec(tmp_path, model={"name": vllm_tiny_path}, rollout={"engine": "vllm", "prompts_per_step": 2, "group_size": 2, "max_new_tokens": 4},
                     optimization={"steps": 3}, checkpoint={"every": 1})
    killed: list[int] = []
    twice = RLJob(spec, job_id="killed-twice", start_server=rollout_server)
    try:
        with pytest.raises(ServerGone) as failed:
            twice.run(on_step=_killer({1, 2}, killed, [], vllm_pool))
    finally:
        twice.close()
    assert killed == [1, 2] and "\n" not in str(failed.value)
    assert re.match(r"^the inference server at unix:/\S+/vllm\.sock is gone: vLLM's server ended: .*; "
                    r"run the job id again to resume from its last checkpoint", str(failed.value)), str(failed.value)
    from opentinker.storage.checkpoint import Owner, latest_checkpoint

    assert latest_checkpoint(spec.checkpoint.base_url, "killed-twice", Owner("killed-twice", None)).step == 2  # where the id resumes


def test_vllm_start_up_failures_read_as_one_line(vllm_pool, vllm_tiny_path):
    """A port taken, a key/value cache that does not fit, an argument refused: `vLLM did not start: <why>` with the
    log's path. The three start at once (each spends its time importing vLLM)."""
    from concurrent.futures import ThreadPoolExecutor

    from opentinker.inference.engine_hf import ModelLoadError
    from opentinker.inference.engine_vllm import VLLMServer, merged_server_args
    from opentinker.inference.launch import free_port

    args, env = merged_server_args(vllm_tiny_path, None, "float32", Path(tempfile.mkdtemp()), "base")

    def refused(extra: list[str], port: int) -> str:
        with pytest.raises(ModelLoadError) as failed:
            VLLMServer([*args, *extra], "127.0.0.1", port, "base", Path(tempfile.mkdtemp()), num_gpus=0, env=env)
        return str(failed.value)

    with socket.socket() as taken, ThreadPoolExecutor(3) as starts:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        lines = [starts.submit(refused, extra, at) for extra, at in (([], port), (["--num-gpu-blocks-override", "1"], free_port("127.0.0.1")),
                                                                      (["--max-model-len", "many"], free_port("127.0.0.1")))]
        on_port, cache, argument = (line.result() for line in lines)
    assert re.match(rf"^vLLM did not start: port {port} on 127.0.0.1 is taken \(exit code 1; log: ", on_port), on_port
    assert re.match(r"^vLLM did not start: the key/value cache does not fit \(\w+Error: .+\); "
                    r"raise OPENTINKER_VLLM_CPU_KV_CACHE_GIB on a CPU, or lower max_model_len \(exit code 1; log: ", cache), cache
    assert re.match(r"^vLLM did not start: its arguments were refused: argument --max-model-len: .+ \(exit code 2; log: ", argument), argument


def test_a_supervised_server_outlives_the_thread_that_started_it_and_names_who_stops_it(tmp_path):
    """vLLM's supervisor lives as long as the process that started it, not the thread (a
    PR_SET_PDEATHSIG would kill it as the thread ends: a job starts its server from whichever thread
    asks), and a SIGTERM is one line in the server's log naming its sender's pid and command line;
    then the group goes. A stand-in command plays the server: no vLLM needed."""
    import subprocess
    import sys
    import threading
    import time

    from opentinker.core.polling import wait_for
    from opentinker.inference.engine_vllm import start_supervised

    log, started = tmp_path / "vllm.log", []

    def start() -> None:  # as a server's start does, the thread waits on (until it is ready), then ends
        started.append(start_supervised([sys.executable, "-c", "import time; time.sleep(300)"], log, dict(os.environ)))
        time.sleep(1.0)

    thread = threading.Thread(target=start)
    thread.start()
    thread.join()
    (supervisor,) = started
    group = os.getpgid(supervisor.pid)
    time.sleep(1.0)
    assert supervisor.poll() is None, log.read_text()  # the thread that started it is gone, the server is not
    sender = subprocess.Popen(["sh", "-c", f"kill -TERM {supervisor.pid}; sleep 30"])
    try:
        supervisor.wait(timeout=30)
    finally:
        sender.kill()
    assert (f"[opentinker] supervisor: SIGTERM from pid {sender.pid} (sh -c kill -TERM {supervisor.pid}; sleep 30; "
            f"the starter is {os.getpid()}): the server's process group is killed") in log.read_text()
    wait_for(lambda: not [p for p in psutil.process_iter() if _live_in(p, group)] or None, interval=0.2, timeout=15.0,
             what="the server's process group to go")


def _live_in(process, group: int) -> bool:
    """Whether the process is alive (zombies wait only for their reaper) and in the process group."""
    try:
        return os.getpgid(process.pid) == group and process.status() != psutil.STATUS_ZOMBIE
    except (ProcessLookupError, psutil.Error):
        return False


def test_the_default_engine_samples_through_vllm_in_the_stacks_ray_actor(stack_env, vllm_pool, vllm_tiny_path, tmp_path, caplog):
    """The product's path: a job with the default `rollout.engine` (auto) run as a flow on the
    stack. Its Ray actor starts vLLM as its own child, every step's weights reach it (the probe
    checked, in float32), MLflow says which engine was chosen and why, and no server outlives the job:
    the actor is killed at the job's end (its process ends with no cleanup of its own, as by SIGKILL),
    and the server's supervisor takes its whole group, the engine core (a process of its own, renamed
    VLLM::EngineCore) included."""
    import threading

    from mlflow.tracking import MlflowClient

    from flows.rl_train import rl_train

    vllm_pool.room()  # memory for the job's own server
    before = _vllm_processes()
    settings, _ = stack_env
    spec = tiny_spec(tmp_path, model={"name": vllm_tiny_path}, rollout={"prompts_per_step": 2, "group_size": 2, "max_new_tokens": 4},
                     optimization={"steps": 2}, evaluation={"every": 2, "n_samples": 4}, checkpoint={"every": 1})
    assert spec.rollout.engine == "auto"
    seen: dict[int, str] = {}  # the job's vLLM processes, by pid, watched while it runs
    done = threading.Event()

    def watch() -> None:
        while not done.wait(0.5):
            for pid in _vllm_processes() - before:
                with contextlib.suppress(psutil.Error):
                    seen.setdefault(pid, psutil.Process(pid).name())

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        result = rl_train(spec, job_id="auto-vllm")
    finally:
        done.set()
        watcher.join()
    gaps = [h["rollout/sync_logprob_gap"] for h in result["history"] if "rollout/sync_logprob_gap" in h]
    assert len(gaps) == 2 and max(gaps) < 1e-3, result["history"]  # steps 1 and 2 sampled versions 0 and 1, each verified
    lines = [r.getMessage() for r in caplog.records]  # the job's log says how its trainer computes, decided in its actor
    assert "job auto-vllm: model.dtype auto on the CPU: float32 (OPENTINKER_CPU_AUTO_DTYPE is set)" in lines, lines
    client = MlflowClient(tracking_uri=settings.mlflow_url)
    (run,) = client.search_runs([client.get_experiment_by_name(settings.project).experiment_id],
                                filter_string="tags.`opentinker.job_id` = 'auto-vllm'")
    assert run.data.tags["opentinker.rollout_engine"] == "rollout.engine auto chose vllm (sampler_dtype auto)"
    assert any(name.startswith("VLLM") for name in seen.values()), seen  # the engine core ran apart
    assert wait_gone(set(seen)), {pid: name for pid, name in seen.items() if psutil.pid_exists(pid)}


def test_auto_chooses_local_where_vllm_cannot_sample_the_job(tmp_path, monkeypatch):
    """Each reason `auto` falls back to the in-process engine, as the one line the job logs."""
    from opentinker.rl.engine_choice import choose_engine

    def chose(starts_servers: bool = True, **overrides) -> str:
        spec, line = choose_engine(tiny_spec(tmp_path, **overrides), starts_servers)
        assert spec.rollout.engine == ("vllm" if "chose vllm" in line else "local")
        return line

    assert chose() == ("rollout.engine auto chose local: vLLM cannot run tiny-random here: its attention heads are of size 16, "
                       "which vllm-cpu's attention does not take (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)")
    assert "full fine-tune" not in chose(adapter={"kind": "full"}, model={"name": "smollm2-135m-instruct"})  # it samples through vLLM too
    assert chose(starts_servers=False).endswith(": this process starts no inference server")
    monkeypatch.setenv("OPENTINKER_VLLM_PYTHON", str(tmp_path / "none"))
    line = chose(model={"name": "smollm2-135m-instruct"}, rollout={"sampler_dtype": "bfloat16"})
    assert line.startswith("rollout.engine auto chose local: engine 'vllm' needs vLLM's own environment (OPENTINKER_VLLM_PYTHON=")
    spec, _ = choose_engine(tiny_spec(tmp_path, model={"name": "smollm2-135m-instruct"}, rollout={"sampler_dtype": "bfloat16"}), True)
    assert spec.rollout.sampler_dtype == "auto"  # vLLM's precision does not apply to the local engine


def wait_gone(pids: set[int], timeout: float = 30.0) -> bool:
    _, alive = psutil.wait_procs([psutil.Process(p) for p in pids if psutil.pid_exists(p)], timeout=timeout)
    return not alive


@pytest.mark.slow  # a server of its own (~45 s); the stack's test above kills its job's actor and watches the same group go
def test_a_killed_job_process_leaves_no_vllm_process_behind(vllm_tiny_path, tmp_path):
    """A process that started a vLLM server dies by SIGKILL (a flow process, a Ray actor killed at
    its job's end): the server's supervisor kills its whole group, the engine core (a process of
    its own, renamed VLLM::EngineCore) included."""
    import subprocess
    import sys

    from tests.vllm_fixtures import vllm_missing

    if reason := vllm_missing():
        pytest.skip(reason)
    code = ("import sys, time, tempfile; from pathlib import Path\n"
            "from opentinker.inference.engine_vllm import VLLMServer, merged_server_args\n"
            "from opentinker.inference.launch import free_port\n"
            "work = Path(tempfile.mkdtemp()); args, env = merged_server_args(sys.argv[1], None, 'float32', work, 'base')\n"
            "VLLMServer(args, '127.0.0.1', free_port('127.0.0.1'), 'base', work, num_gpus=0, env=env)\n"
            "print('up', flush=True); time.sleep(600)\n")
    starter = subprocess.Popen([sys.executable, "-c", code, vllm_tiny_path], stdout=subprocess.PIPE, text=True)
    try:
        assert starter.stdout.readline().strip() == "up"
        group = {p.pid for p in psutil.Process(starter.pid).children(recursive=True)}
        assert any(psutil.Process(p).name().startswith("VLLM") for p in group)  # the engine core runs apart
    finally:
        starter.kill()
        starter.wait()
    assert wait_gone(group), [psutil.Process(p).name() for p in group if psutil.pid_exists(p)]


def test_an_engine_that_dies_under_a_job_is_server_gone_saying_so(vllm_pool, vllm_tiny_path):
    """vLLM's engine dies while its API server lives (a request for prompt logprobs on a server with
    LoRA enabled kills vllm-cpu 0.32.0's engine: a bug of its own, used here as the way to kill it):
    the job's next request is ServerGone with what the health check saw, the log's error and the resume
    hint, not "answered 500: EngineCore encountered an issue". vLLM's watchdog stops the API server
    within 5 s of its engine's death, so a loaded machine may see the 503 or no answer at all."""
    from opentinker.backend import SamplingParams
    from opentinker.backend.server_engine import ServerGone, ServerRolloutEngine
    from opentinker.inference.engine_vllm import VLLMServer, adapter_server_args
    from opentinker.inference.launch import free_port

    vllm_pool.room()  # memory for a server of its own, which this test breaks
    workdir = Path(tempfile.mkdtemp())
    args = adapter_server_args(vllm_tiny_path, None, "float32", 8, workdir, "base")
    server = VLLMServer(args, "127.0.0.1", free_port("127.0.0.1"), "base", workdir, num_gpus=0, api_key="k" * 24,
                        env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"})
    engine = ServerRolloutEngine(server.handle("lora"), TOLERANCE)
    try:
        assert len(engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=2, greedy=True))) == 1
        killer = {"model": "base", "prompt": [[1, 2, 3, 4, 5], [6, 7]], "max_tokens": 2, "prompt_logprobs": 1, "temperature": 0}
        engine.client.post("/v1/completions", json=killer)
        with pytest.raises(ServerGone) as gone:
            for _ in range(3):  # the engine may finish what it had before it dies
                engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=2, greedy=True))
    finally:
        engine.close()  # stops the server (owned)
    line = str(gone.value)
    health = r"(its health check answers 503 \(its engine died\)|it does not answer its health check \(\w+\))"
    assert "\n" not in line and re.match(rf"^the inference server at http://127\.0\.0\.1:\d+ is gone: {health}: .+ "
                                         r"\(log: \S+vllm\.log\); run the job id again to resume from its last checkpoint$", line), line
