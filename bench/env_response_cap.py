"""Peak memory of a job whose environment server answers huge observations, against one whose
server answers normal ones, in the same run.

Before OPENTINKER_ENV_MAX_RESPONSE_BYTES a step answering a 100 MB observation took a job's
process to 16.7 GB in about 4 minutes (the OOM killer ended it, no message), and 5 MB observations
made a step take 116 s at 3.9 GB: the whole answer was decoded before any limit. Now an answer is
counted as it streams in and refused past the limit (default 4 MiB), the connection closed.

Each way is a short in-process job (RLJob, the tiny random model, --steps steps of 4 prompts x 4
samples, one turn, evaluation on 4 tasks before and after) in a fresh process, its env.url a local
server in another process (this file, `--serve`) whose every step answers an observation of the
way's size: announced (Content-Length, as `opentinker env serve` answers) or streamed (chunked, no
length: the client must count). Per way: the job process's peak RSS (VmHWM), its RSS once the
model is loaded, step seconds, failed episodes and the reason, and the slowest of 16 concurrent
environment steps (answered or refused) timed alone. The ways run one after the other,
normal first; the goal: every huge way's peak RSS within 1.5 GB of the normal way's.
`--uncapped-mb` adds a way with the limit lifted to 1 GiB: what accepting such answers costs.

    python bench/env_response_cap.py --observation-mb 100 --steps 3 --uncapped-mb 5
writes bench/results/env_response_cap.{json,md}
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from opentinker.core.polling import wait_healthy  # noqa: E402 - after the checkout is on the path
MiB = 1024**2
GOAL_BYTES = 1.5e9


# --- the environment server (its own process) --------------------------------------------------


def server_app(observation_bytes: int, announce: bool):
    """The env server protocol (opentinker.env.server) with a step answering `observation_bytes`
    of text, sent in 1 MiB chunks so that the server itself never holds it."""
    import uuid

    from starlette.applications import Starlette
    from starlette.responses import JSONResponse, StreamingResponse
    from starlette.routing import Route

    prompts = {"system_prompt": "Answer in one word.", "initial_user_message": "", "example_turns": []}
    head, tail = b'{"observation": "', b'", "reward": 0.5, "done": true, "info": {}}'
    chunk = b"x" * MiB

    async def sessions(request):
        return JSONResponse({"session_id": uuid.uuid4().hex, **prompts})

    async def reset(request):
        return JSONResponse({"observation": "Say a word.", **prompts})

    async def step(request):
        if observation_bytes <= 1024:
            return JSONResponse({"observation": "x" * observation_bytes, "reward": 0.5, "done": True, "info": {}})

        async def body():
            for part in [head] + [chunk] * (observation_bytes // MiB) + [chunk[: observation_bytes % MiB], tail]:
                if await request.is_disconnected():  # the job closed the connection: this server (same machine) stops too
                    return
                yield part

        length = {"Content-Length": str(len(head) + observation_bytes + len(tail))} if announce else None
        return StreamingResponse(body(), headers=length, media_type="application/json")

    async def close(request):
        return JSONResponse({"ok": True})

    async def health(request):
        return JSONResponse({"ok": True})

    return Starlette(routes=[Route("/sessions", sessions, methods=["POST"]), Route("/sessions/{sid}/reset", reset, methods=["POST"]),
                             Route("/sessions/{sid}/step", step, methods=["POST"]), Route("/sessions/{sid}", close, methods=["DELETE"]),
                             Route("/health", health)])


def serve(port: int, observation_bytes: int, announce: bool) -> None:
    import uvicorn

    uvicorn.run(server_app(observation_bytes, announce), host="127.0.0.1", port=port, log_level="warning", access_log=False)


# --- the job (its own process) -----------------------------------------------------------------


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def run_job(url: str, steps: int) -> dict:
    from opentinker.core.settings import get_settings
    from opentinker.core.spec import parse_spec
    from opentinker.model.policy import load_model
    from opentinker.rl import RLJob

    with tempfile.TemporaryDirectory() as tmp:
        spec = parse_spec({
            "model": {"name": "tiny-random"}, "adapter": {"kind": "lora", "r": 8, "alpha": 16},
            "rollout": {"prompts_per_step": 4, "group_size": 4, "max_new_tokens": 8},
            "optimization": {"lr": 1e-3, "steps": steps, "micro_batch_size": 8},
            "evaluation": {"every": 0, "n_samples": 4}, "checkpoint": {"every": steps, "base_url": f"file://{tmp}/runs"},
            "health": {"max_failure_rate": 1.0, "unhealthy_steps": steps + 1},  # a way whose every episode fails still runs its steps
            "env": {"url": url, "timeout_s": 30, "config": {"dataset": [{"id": i} for i in range(8)], "val_dataset": [{"id": 8 + i} for i in range(4)]}},
            "seed": 0})
        load_model(spec.model.name)  # what loading the model costs, before any episode
        loaded_kib = _status_kib("VmRSS")
        seen = []
        t0 = time.perf_counter()
        RLJob(spec, job_id="bench-env-cap").run(on_step=seen.append)
        seconds = time.perf_counter() - t0
    return {"peak_rss_bytes": _status_kib("VmHWM") * 1024, "rss_after_model_load_bytes": loaded_kib * 1024, "job_seconds": seconds,
            "step_seconds": [r.metrics["step/seconds"] for r in seen],
            "episodes": sum(r.metrics["rollout/episodes"] for r in seen), "failed_episodes": sum(r.metrics["rollout/failed_episodes"] for r in seen),
            "first_failure": seen[-1].metrics.get("rollout/first_failure"), "limit_bytes": get_settings().env_max_response_bytes}


# --- the bench ---------------------------------------------------------------------------------


def slowest_of_concurrent_steps(url: str, limit: int | None, episodes: int = 16, rounds: int = 3) -> float:
    """The median over `rounds` of the slowest of `episodes` concurrent steps (answered or refused),
    from the job's side of the wire without a job around it."""
    from concurrent.futures import ThreadPoolExecutor

    from opentinker.core.settings import Settings
    from opentinker.env.remote import RemoteGameClass, RemoteGameError

    game_class = RemoteGameClass(url, timeout_s=30, max_response_bytes=limit or Settings.model_fields["env_max_response_bytes"].default)

    def step() -> float:
        game = game_class()
        game.reset()
        t0 = time.perf_counter()
        try:
            game.step("word")
        except RemoteGameError:
            pass
        seconds = time.perf_counter() - t0
        game.close()
        return seconds

    with ThreadPoolExecutor(episodes) as pool:
        slowest = [max(pool.map(lambda _: step(), range(episodes))) for _ in range(rounds)]
    game_class.close()
    return statistics.median(slowest)


def one_way(name: str, observation_bytes: int, announce: bool, steps: int, limit: int | None = None) -> dict:
    """One job against one server; `limit`: OPENTINKER_ENV_MAX_RESPONSE_BYTES (None: the default)."""
    from opentinker.control.services import free_ports

    (port,) = free_ports(1)
    url = f"http://127.0.0.1:{port}"
    env = {k: v for k, v in os.environ.items() if k != "OPENTINKER_ENV_MAX_RESPONSE_BYTES"}
    if limit:
        env["OPENTINKER_ENV_MAX_RESPONSE_BYTES"] = str(limit)
    env.setdefault("OPENTINKER_SECRET", "bench-secret")  # signs the job's token: no secret file written in ~/.opentinker
    server = subprocess.Popen([sys.executable, __file__, "--serve", str(observation_bytes), "--port", str(port)] + (["--announce"] if announce else []),
                              env=env, stderr=subprocess.DEVNULL)  # uvicorn's complaints about writes to the connections the job closed
    try:
        wait_healthy(url)
        out = subprocess.run([sys.executable, __file__, "--job", url, "--steps", str(steps)], env=env, capture_output=True, text=True, timeout=1800)
        if out.returncode != 0:
            raise RuntimeError(f"{name}: the job's process ended with {out.returncode}: {out.stderr[-3000:]}")
        result = json.loads(out.stdout.strip().splitlines()[-1])
        result["slowest_of_16_steps_seconds"] = slowest_of_concurrent_steps(url, limit)
    finally:
        server.kill()
        server.wait()
    return {"way": name, "observation_bytes": observation_bytes, "announced": announce, "limit_lifted": bool(limit), **result}


def _gb(n: float) -> str:
    return f"{n / 1e9:.2f}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--observation-mb", type=float, default=100)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--uncapped-mb", type=float, default=0,
                        help="also a way with observations of this size and the limit lifted to 1 GiB (keep it small: 100 MB ran a job out of memory)")
    parser.add_argument("--serve", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--announce", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--job", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve is not None:
        serve(args.port, args.serve, args.announce)
        return 0
    if args.job:
        print(json.dumps(run_job(args.job, args.steps)), flush=True)
        return 0

    huge = int(args.observation_mb * 1e6)
    ways = [("normal (16-byte observations)", 16, True), ("5 MB observations, announced", 5_000_000, True),
            (f"{args.observation_mb:g} MB observations, announced", huge, True),
            (f"{args.observation_mb:g} MB observations, streamed (no length)", huge, False)]
    if args.uncapped_mb:
        ways.append((f"{args.uncapped_mb:g} MB observations, the limit lifted to 1 GiB", int(args.uncapped_mb * 1e6), True, 1024**3))
    runs = []
    for name, size, announce, *limit in ways:
        runs.append(one_way(name, size, announce, args.steps, *limit))
        r = runs[-1]
        print(f"{name}: peak RSS {_gb(r['peak_rss_bytes'])} GB, {r['failed_episodes']:g} of {r['episodes']:g} episodes failed, "
              f"steps {', '.join(f'{s:.1f}' for s in r['step_seconds'])} s", flush=True)
    normal = runs[0]
    for r in runs[1:]:
        r["peak_over_normal_bytes"] = r["peak_rss_bytes"] - normal["peak_rss_bytes"]
        r["peak_ratio_to_normal"] = r["peak_rss_bytes"] / normal["peak_rss_bytes"]
    worst = max(r["peak_over_normal_bytes"] for r in runs[1:] if not r["limit_lifted"])
    met = worst <= GOAL_BYTES
    result = {"command": f"python bench/env_response_cap.py --observation-mb {args.observation_mb:g} --steps {args.steps}"
                         + (f" --uncapped-mb {args.uncapped_mb:g}" if args.uncapped_mb else ""),
              "observation_mb": args.observation_mb, "steps": args.steps, "runs": runs, "worst_peak_over_normal_bytes": worst,
              "goal": "every huge way's peak RSS within 1.5 GB of the normal way's", "met": met,
              "machine": f"{platform.machine()}, {os.cpu_count()} cores", "python": platform.python_version()}
    out = ROOT / "bench" / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / "env_response_cap.json").write_text(json.dumps(result, indent=1))
    rows = "\n".join(
        f"| {r['way']} | {_gb(r['peak_rss_bytes'])} | {_gb(r.get('peak_over_normal_bytes', 0)) if r is not normal else '—'} | "
        f"{r.get('peak_ratio_to_normal', 1.0):.2f}x | {statistics.median(r['step_seconds']):.1f} | {r['slowest_of_16_steps_seconds']:.2f} | {r['failed_episodes']:g} of {r['episodes']:g} |"
        for r in runs)
    reason = next((r["first_failure"] for r in runs[1:] if r["first_failure"] and not r["limit_lifted"]), "")
    limit = normal["limit_bytes"]
    (out / "env_response_cap.md").write_text(
        f"# A job's memory when its environment server answers huge observations (same run)\n\n"
        f"An in-process job (`tiny-random`, {args.steps} steps of 16 one-turn episodes, evaluation on 4 tasks before and after) "
        f"against a local server whose every step answers an observation of the way's size; the default "
        f"`OPENTINKER_ENV_MAX_RESPONSE_BYTES` ({limit:,} bytes). Peak RSS is the job process's VmHWM "
        f"(its RSS once the model was loaded: {_gb(normal['rss_after_model_load_bytes'])} GB). Job step seconds (generation, "
        f"update, the last one the final evaluation) are noisy on a shared {os.cpu_count()}-core machine; the environment's share is "
        f"the slowest of 16 concurrent steps against the same server from the job's side, without a job (median of 3 rounds).\n\n"
        f"| way | peak RSS (GB) | over normal (GB) | ratio to normal | median job step (s) | 16 concurrent env steps (s) | failed episodes |\n"
        f"|---|---:|---:|---:|---:|---:|---:|\n{rows}\n\n"
        f"Worst peak over the normal way, under the limit: **{_gb(worst)} GB** (goal ≤ 1.5 GB: {'met' if met else 'not met'}); "
        f"before the limit, 100 MB observations took a job to 16.7 GB and the OOM killer. Each refused episode reads, e.g.:\n\n"
        f"    {reason}\n")
    print(f"worst peak RSS over normal: {_gb(worst)} GB (goal <= 1.5 GB: {'met' if met else 'not met'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
