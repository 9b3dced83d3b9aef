"""Multi-turn rollouts with and without the prefix cache, side by side in one run (SmolLM2, CPU).

Every turn of a multi-turn episode used to prefill the whole conversation again; with the prefix
cache (`rollout.prefix_cache_tokens`, opentinker/backend/prefix_cache.py) a turn runs only the
tokens added since the last one. This runs the same seeded job twice in this process, first with
the cache off (the baseline), then on: an evaluation of `--eval-n` held-out episodes (sampled,
the training temperature), then `--steps` training steps (rollout + update). Both sides draw the
same random numbers, so their records should be the same tokens (the cache changes the float
sums only); the bench counts how many are.

    python bench/multiturn_rollout.py [--game gomoku|math_tool] [--steps 2] [--eval-n 16]
writes bench/results/multiturn_rollout_<game>.json and .md
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

GAMES = {
    # the Gomoku learning bench's setting: 6x6, 4 in a row, X vs random, one example exchange, 8 turns
    "gomoku": {
        "rollout": {"prompts_per_step": 2, "group_size": 4, "max_new_tokens": 8, "temperature": 1.0, "max_turns": 8,
                    "max_total_tokens": 1536},
        "optimization": {"lr": 5e-4, "micro_batch_size": 1},
        "env": {"game": "envs.gomoku:GomokuGame",
                "config": {"model_plays": "X", "game_kwargs": {"size": 6, "win_length": 4, "opponent": "random",
                                                                "max_illegal": 2, "few_shot": 1}}},
    },
    # examples/math_tool_grpo.yaml: calculator calls, up to 4 turns
    "math_tool": {"spec": "examples/math_tool_grpo.yaml"},
}


def build_spec(game: str, cache_tokens: int, steps: int, eval_n: int, tmp: str):
    from opentinker.core.spec import load_spec, parse_spec

    setting = GAMES[game]
    if "spec" in setting:
        data = load_spec(ROOT / setting["spec"]).model_dump(mode="json")
    else:
        data = {"model": {"name": "smollm2-135m-instruct"}, "adapter": {"kind": "lora", "r": 16, "alpha": 32},
                "algorithm": {"advantage": "grpo"}, "seed": 0} | setting
    data["rollout"] = dict(data["rollout"]) | {"prefix_cache_tokens": cache_tokens}
    data["optimization"] = dict(data["optimization"]) | {"steps": steps}
    data["evaluation"] = {"every": 0, "greedy": False, "n_samples": eval_n}
    data["checkpoint"] = {"every": 0, "base_url": f"file://{tmp}"}
    data["env"] = dict(data["env"]) | {"config": dict(data["env"]["config"]) | {"val_size": eval_n}}
    return parse_spec(data)


def run_side(game: str, cache_tokens: int, steps: int, eval_n: int) -> dict:
    import torch

    from opentinker.rl import RLJob
    from opentinker.core.seeding import seed_everything

    with tempfile.TemporaryDirectory() as tmp:
        spec = build_spec(game, cache_tokens, steps, eval_n, tmp)
        job = RLJob(spec, job_id=f"bench-multiturn-{cache_tokens}")
        engine = job.sampler.engine
        seed_everything(spec.seed)
        t0 = time.perf_counter()
        with torch.no_grad():
            ev = job.sampler.evaluate(0)
        eval_s = time.perf_counter() - t0
        rollouts, updates = [], []
        records = [t["messages"] for t in ev.transcripts]  # evaluation: the conversations; training: the token records
        for step in range(steps):
            t0 = time.perf_counter()
            job.rollout(step)
            batch = job.sampler.batch(step)
            rollouts.append(time.perf_counter() - t0)
            records += [t.token_ids for t in batch.trajectories]
            t0 = time.perf_counter()
            job.update(step)
            updates.append(time.perf_counter() - t0)
        turns = sum(len(t.turns) for t in batch.trajectories) / max(1, len(batch.trajectories))
        return {"prefix_cache_tokens": cache_tokens, "eval_seconds": eval_s, "eval_turns_mean": ev.metrics.get("eval/turns_mean"),
                "rollout_seconds": rollouts, "update_seconds": updates, "train_turns_mean_last_step": turns,
                "tokens_from_cache": engine.prefix_cache.hit_tokens, "generated_tokens": engine.generated_tokens,
                "records": records}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--game", choices=sorted(GAMES), default="gomoku")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--eval-n", type=int, default=16)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    import torch

    from opentinker.cli.common import quiet_libraries

    quiet_libraries()
    torch.set_num_threads(os.cpu_count() or 1)
    out_path = Path(args.out or ROOT / "bench" / "results" / f"multiturn_rollout_{args.game}")
    sides = {}
    for label, tokens in (("baseline: no reuse", 0), ("prefix cache", 65536)):
        print(f"[{label}] {args.game}: evaluation of {args.eval_n} episodes, then {args.steps} steps", flush=True)
        sides[label] = run_side(args.game, tokens, args.steps, args.eval_n)
        s = sides[label]
        print(f"[{label}] eval {s['eval_seconds']:.1f}s, rollouts {[round(x, 1) for x in s['rollout_seconds']]}s, "
              f"updates {[round(x, 1) for x in s['update_seconds']]}s, {s['tokens_from_cache']} prompt tokens from the cache", flush=True)
    base, ours = sides["baseline: no reuse"], sides["prefix cache"]
    base_records, our_records = base.pop("records"), ours.pop("records")
    same, n_records = sum(a == b for a, b in zip(base_records, our_records)), len(base_records)
    rollout_base, rollout_ours = sum(base["rollout_seconds"]), sum(ours["rollout_seconds"])
    step_base = rollout_base + sum(base["update_seconds"])
    step_ours = rollout_ours + sum(ours["update_seconds"])
    ratios = {"evaluation": base["eval_seconds"] / ours["eval_seconds"], "training rollouts": rollout_base / rollout_ours,
              "training steps (rollout + update)": step_base / step_ours}
    result = {"machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__},
              "game": args.game, "steps": args.steps, "eval_n": args.eval_n, "sides": sides, "ratios": ratios,
              "identical_records": same, "records": n_records}
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.with_suffix(".json").write_text(json.dumps(result, indent=2))
    lines = [f"# Multi-turn rollouts with and without the prefix cache: {args.game}, SmolLM2-135M-Instruct (CPU)", "",
             f"Same seeded job twice in one run: {args.eval_n} held-out episodes sampled at the training temperature, then "
             f"{args.steps} training steps. Command: `python bench/multiturn_rollout.py {' '.join(sys.argv[1:])}`.", "",
             "| | no reuse (baseline) | prefix cache | speed-up |", "|---|---:|---:|---:|",
             f"| evaluation, {args.eval_n} episodes | {base['eval_seconds']:.1f} s | {ours['eval_seconds']:.1f} s | {ratios['evaluation']:.2f}× |",
             f"| training rollouts, {args.steps} steps | {rollout_base:.1f} s | {rollout_ours:.1f} s | {ratios['training rollouts']:.2f}× |",
             f"| training steps (rollout + update) | {step_base:.1f} s | {step_ours:.1f} s | {ratios['training steps (rollout + update)']:.2f}× |",
             "",
             f"Prompt tokens served from the cache: {ours['tokens_from_cache']}. Mean turns per episode: evaluation "
             f"{ours['eval_turns_mean']:.1f}, last training step {ours['train_turns_mean_last_step']:.1f}. Records identical "
             f"token for token on both sides: {same} of {n_records}"
             + ("." if same == n_records else " (the rest differ after a sampled token flipped on a float difference, which "
                "the cache may cause; each side's logprobs are exact for its own record)."), ""]
    out_path.with_suffix(".md").write_text("\n".join(lines))
    print("\n".join(lines), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
