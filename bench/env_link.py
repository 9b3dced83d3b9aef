"""Environment steps per second through the client link against `opentinker env serve`, in the
same run.

Both sides play the same game (envs.toy:UppercaseGame) from the job's side of the wire, the way the
agent loop does: E episodes at once, each call in its own thread (reset, then T steps each). (a)
`opentinker env serve` in its own process, reached by HTTP per call (RemoteGameClass); (b) the
game hosted by a client process behind the gateway (EnvironmentLink), the job's calls batched and
relayed over the client's WebSocket (LinkedGameClass). A real embedded stack supplies the gateway.
Rounds alternate a, b, a, b, …; the ratio is b/a of the median rates.

    python bench/env_link.py --episodes 64 --turns 8 --rounds 3
writes bench/results/env_link.{json,md}
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
GAME = "envs.toy:UppercaseGame"


def play(game_class, episodes: int, turns: int) -> float:
    """Environment calls per second for `episodes` concurrent episodes of `turns` steps."""
    from opentinker.agent.guard import call_many_with_timeout

    games = [game_class() for _ in range(episodes)]
    t0 = time.perf_counter()
    outcomes = call_many_with_timeout([(g.reset, (), {"prompt": f"item {i}"}) for i, g in enumerate(games)], 60)
    calls = len(games)
    for _ in range(turns):
        outcomes += call_many_with_timeout([(g.step, ("Yes",), {}) for g in games], 60)
        calls += len(games)
    seconds = time.perf_counter() - t0
    failed = [o.error for o in outcomes if o.error]
    if failed:
        raise RuntimeError(f"{len(failed)} calls failed, e.g. {failed[0]}")
    for g in games:
        g.close()
    return calls / seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int, default=64)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    import httpx

    from envs.toy import UppercaseGame
    from opentinker.client.link import EnvironmentLink
    from opentinker.control.gateway.tenants import TenantStore
    from opentinker.control.stack import Stack
    from opentinker.control.submit import deploy
    from opentinker.core.settings import mlflow_env, prefect_env, settings_env
    from opentinker.env.linked import LinkedGameClass
    from opentinker.env.remote import RemoteGameClass
    from tests.stack_fixtures import free_ports, local_settings

    with tempfile.TemporaryDirectory() as tmp:
        settings = local_settings(Path(tmp) / "state", secret="bench-secret")
        os.environ.update(settings_env(settings) | prefect_env(settings) | mlflow_env(settings))
        stack = Stack(settings)
        served = None
        try:
            stack.up(timeout=240)
            deploy(settings)
            key = TenantStore(settings.state_dir / "tenants.json").create("bench")
            config = {"model": {"name": "tiny-random"}, "storage": {"base_url": f"file://{tmp}/runs"}}
            job = httpx.post(f"{settings.gateway_url}/v1/jobs", json={"config": config}, headers={"Authorization": f"Bearer {key}"},
                             timeout=60).json()  # parked until fit(): the bench plays the job's side itself
            (port,) = free_ports(1)
            served = subprocess.Popen([sys.executable, "-m", "opentinker.cli", "env", "serve", GAME, "--port", str(port),
                                       "--token", job["job_token"]], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            wait_healthy(f"http://127.0.0.1:{port}")
            link = EnvironmentLink(settings.gateway_url, key, job["job_id"], UppercaseGame).open()
            sides = {"served": RemoteGameClass(f"http://127.0.0.1:{port}", token=job["job_token"]),
                     "link": LinkedGameClass(settings.gateway_url, job["job_id"], job["job_token"], "UppercaseGame")}
            play(sides["served"], 4, 1), play(sides["link"], 4, 1)  # warm up both
            rates: dict[str, list[float]] = {"served": [], "link": []}
            for r in range(args.rounds):
                for name, game_class in sides.items():
                    rates[name].append(play(game_class, args.episodes, args.turns))
                print(f"round {r + 1}: served {rates['served'][-1]:.0f} calls/s, link {rates['link'][-1]:.0f} calls/s", flush=True)
            frames_per_call = link.frames / max(link.calls, 1)
            link.close()
        finally:
            if served is not None:
                served.kill()
            stack.down()

    served_rate, link_rate = statistics.median(rates["served"]), statistics.median(rates["link"])
    ratio = link_rate / served_rate
    result = {"episodes": args.episodes, "turns": args.turns, "rounds": args.rounds, "rates": rates,
              "served_calls_per_s": served_rate, "link_calls_per_s": link_rate, "ratio_link_over_served": ratio,
              "frames_per_call": frames_per_call, "goal": ">= 0.5", "met": ratio >= 0.5,
              "machine": f"{platform.machine()}, {os.cpu_count()} cores", "python": platform.python_version()}
    out = ROOT / "bench" / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / "env_link.json").write_text(json.dumps(result, indent=1))
    (out / "env_link.md").write_text(
        f"# Environment calls per second: client link vs `opentinker env serve` (same run)\n\n"
        f"{args.episodes} concurrent episodes × (reset + {args.turns} steps) of `{GAME}`, {args.rounds} alternating rounds, medians.\n\n"
        f"| path | calls/s |\n|---|---:|\n| `opentinker env serve` (HTTP per call) | {served_rate:.0f} |\n"
        f"| client link through the gateway (batched WebSocket) | {link_rate:.0f} |\n\n"
        f"Ratio link / served: **{ratio:.2f}** (goal ≥ 0.5: {'met' if ratio >= 0.5 else 'not met'}); "
        f"{frames_per_call:.3f} WebSocket frames per call.\n")
    print(f"served {served_rate:.0f} calls/s, link {link_rate:.0f} calls/s: ratio {ratio:.2f} (goal >= 0.5)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
