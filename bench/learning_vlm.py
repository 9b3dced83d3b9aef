"""Learning through the image: a small VLM on ShapesGame (which colour is the shape?), with real
pictures and, in the same run, with blank pictures (the ablation), on this CPU.

Setting (examples/vlm_shapes.yaml): smolvlm-135m-tiny-vision (SmolLM2-135M's real language
weights and tokenizer under a small randomly initialised vision encoder, assembled from config),
LoRA r16 on the language model and the connector trained at its own rate (by the spec); GRPO.
The answer is only in the picture and the 4 choices are always named in one order, so from the
text alone the best is 25%. Reward 1 for the right choice in the game's strict reply format (the
example: the colour word alone). Every evaluation: greedy accuracy on the held-out tasks (never
trained on), the format rate and the share of distinct answers (a policy that always gives one
answer shows ~25% with few distinct answers). Target: the image run >= 60%, the blank run near chance.

    python bench/learning_vlm.py [--steps 20] [--every 5] [--ways image,blank]
writes bench/results/learning_vlm.json and bench/results/learning_vlm.md
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

TARGET, CHANCE = 0.60, 0.25


def train(spec, blank: bool, tmp: str) -> dict:
    """One run of `spec` with real (blank=False) or blank pictures; its greedy held-out curve."""
    from bench.progress import eval_line, step_line
    from opentinker.rl import RLJob

    env = spec.env.model_copy(update={"config": {**spec.env.config, "blank": blank}})
    spec = spec.model_copy(update={"env": env, "checkpoint": spec.checkpoint.model_copy(update={"every": 0, "base_url": f"file://{tmp}"})})
    name = "blank" if blank else "image"
    t0 = time.perf_counter()
    job = RLJob(spec, job_id=f"bench-vlm-{name}")
    load_s = time.perf_counter() - t0
    sampled: dict[int, float] = {}

    def on_step(r):
        sampled[r.step] = r.metrics["rollout/reward_mean"]
        print(f"[{name}] {step_line(r)}", flush=True)

    def on_eval(e):
        print(f"[{name}] {eval_line(e)}", flush=True)

    result = job.run(on_step=on_step, on_eval=on_eval)
    curve = [{"step": ev.step, "greedy_accuracy": ev.metrics["eval/accuracy"], "format_rate": ev.metrics["eval/format_ok"],
              "distinct_answer_share": ev.metrics["eval/distinct_answer_share"], "sampled_train_reward": sampled.get(ev.step)}
             for ev in result.evaluations]
    step_times = sorted(h["step/seconds"] for h in result.history)
    return {"way": name, "model_load_seconds": load_s, "wall_seconds": result.seconds,
            "median_step_seconds": step_times[len(step_times) // 2], "curve": curve,
            "best_accuracy": max(c["greedy_accuracy"] for c in curve), "final_accuracy": curve[-1]["greedy_accuracy"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--every", type=int, default=5)
    parser.add_argument("--ways", default="image,blank", help="comma-separated: image, blank")
    parser.add_argument("--spec", default=str(ROOT / "examples" / "vlm_shapes.yaml"))
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "learning_vlm"))
    args = parser.parse_args()

    import torch

    from opentinker.cli.common import quiet_libraries
    from opentinker.core.spec import load_spec

    quiet_libraries()
    torch.set_num_threads(os.cpu_count() or 1)
    spec = load_spec(args.spec)
    spec = spec.model_copy(update={"optimization": spec.optimization.model_copy(update={"steps": args.steps}),
                                   "evaluation": spec.evaluation.model_copy(update={"every": args.every})})
    runs = []
    for way in args.ways.split(","):
        with tempfile.TemporaryDirectory() as tmp:
            runs.append(train(spec, blank=way.strip() == "blank", tmp=tmp))

    by_way = {r["way"]: r for r in runs}
    image_ok = "image" in by_way and by_way["image"]["best_accuracy"] >= TARGET
    blank_ok = "blank" not in by_way or by_way["blank"]["best_accuracy"] <= CHANCE + 0.15
    out = {"spec": spec.model_dump(mode="json"), "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__},
           "runs": runs, "target": {"image_at_least": TARGET, "blank_at_most": CHANCE + 0.15}, "target_met": image_ok and blank_ok}
    Path(args.out + ".json").write_text(json.dumps(out, indent=2))
    steps = sorted({c["step"] for r in runs for c in r["curve"]})
    cell = {(r["way"], c["step"]): c for r in runs for c in r["curve"]}
    lines = [f"# Learning through the image: {spec.model.name} on ShapesGame (colour, 4 choices), LoRA + GRPO (CPU)", "",
             f"{args.steps} steps of {spec.rollout.prompts_per_step} prompts x {spec.rollout.group_size} samples, "
             f"{spec.rollout.max_new_tokens} new tokens, {spec.adapter.kind} at lr {spec.optimization.lr:g}, vision side "
             f"{spec.adapter.vision_tower} at {spec.adapter.vision_lr or spec.optimization.lr:g}, reply "
             f"{spec.env.config.get('game_kwargs', {}).get('reply', 'letter')!r}; greedy evaluation on {spec.env.config.get('val_size', 64)} "
             "held-out tasks. The blank run is the same training with white pictures (chance: 25%).", "",
             "| step | " + " | ".join(f"{r['way']}: accuracy (format, distinct)" for r in runs) + " |",
             "|---:|" + "---:|" * len(runs)]
    for s in steps:
        row = []
        for r in runs:
            c = cell.get((r["way"], s))
            row.append("-" if c is None else f"{c['greedy_accuracy']:.1%} ({c['format_rate']:.0%}, {c['distinct_answer_share']:.0%})")
        lines.append(f"| {s} | " + " | ".join(row) + " |")
    lines += [""] + [f"- {r['way']}: best {r['best_accuracy']:.1%}, wall {r['wall_seconds']:.0f} s, median step {r['median_step_seconds']:.1f} s"
                     for r in runs]
    lines += ["", f"Target (image >= {TARGET:.0%}, blank <= {CHANCE + 0.15:.0%}): " + ("met" if out["target_met"] else "NOT met"), ""]
    Path(args.out + ".md").write_text("\n".join(lines))
    print("\n".join(lines))
    return 0 if out["target_met"] else 1


if __name__ == "__main__":
    sys.exit(main())
