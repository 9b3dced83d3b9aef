"""Seconds per RL step: OpenTinker vs TRL's GRPOTrainer doing the same work, side by side.

Same model (SmolLM2-135M-Instruct, fp32, CPU), same LoRA (r16, alpha 32, all linear projections),
same prompts (the math conversation of examples/math_grpo.yaml), 8 prompts x G samples, at most
32 new tokens at T=1, one optimizer step per batch, no KL term; G = 4 (the demo's) and G = 8 (how
each side's cost grows with the group). Each side runs `--steps` steps per group size; the first is
a warm-up and is not counted. Per step and side: rollout and update seconds, and the update's
token positions computed (forward and backward) vs. trained (that carry loss). Prints the median
seconds and the ratio TRL / OpenTinker (higher is better for OpenTinker), and writes
bench/results/step_vs_trl.{json,md}.

    python bench/step_vs_trl.py [--steps 4] [--groups 4,8]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PROMPTS, NEW_TOKENS, LORA_R, LR = 8, 32, 16, 2e-4


def _spec(tmp: str, group: int):
    from opentinker.core.spec import load_spec

    spec = load_spec(ROOT / "examples" / "math_grpo.yaml")
    return spec.model_copy(update={
        "rollout": spec.rollout.model_copy(update={"prompts_per_step": PROMPTS, "group_size": group, "max_new_tokens": NEW_TOKENS}),
        "optimization": spec.optimization.model_copy(update={"lr": LR, "micro_batch_size": PROMPTS * group}),
        "checkpoint": spec.checkpoint.model_copy(update={"base_url": f"file://{tmp}"}),
    })


def time_opentinker(steps: int, group: int) -> list[dict]:
    from opentinker.rl import RLJob

    with tempfile.TemporaryDirectory() as tmp:
        job = RLJob(_spec(tmp, group), job_id="bench-step")
        out = []
        for step in range(steps):
            t0 = time.perf_counter()
            rolled = job.rollout(step)
            t1 = time.perf_counter()
            updated = job.update(step)
            t2 = time.perf_counter()
            out.append({"step_s": t2 - t0, "rollout_s": t1 - t0, "update_s": t2 - t1, "reward": rolled["rollout/reward_mean"],
                        "positions_computed": updated["update/positions_computed"], "positions_trained": updated["update/positions_trained"]})
            print(f"opentinker G={group} step {step}: {out[-1]['step_s']:.1f}s (rollout {out[-1]['rollout_s']:.1f}, "
                  f"update {out[-1]['update_s']:.1f}) positions {out[-1]['positions_computed']:.0f}/{out[-1]['positions_trained']:.0f}", flush=True)
    return out


def time_trl(steps: int, group: int) -> list[dict]:
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from envs.math import MathGame, parse_answer
    from opentinker.env import GameEnvironment
    from opentinker.core.model_names import SMOLLM2
    from opentinker.model.policy import load_model

    with tempfile.TemporaryDirectory() as tmp:
        spec = _spec(tmp, group)
        env = GameEnvironment(MathGame, spec)
        game = env.make_game()
        rows = []
        for task in env.train_tasks(PROMPTS * (steps + 1)):
            messages = [{"role": "system", "content": game.get_system_prompt()}, *game.get_example_turns(),
                        {"role": "user", "content": task["question"]}]
            rows.append({"prompt": messages, "answer": task["answer"]})

        def correct(completions, answer, **_):
            return [1.0 if parse_answer(c[-1]["content"]) == a else 0.0 for c, a in zip(completions, answer)]

        model, tok = load_model(SMOLLM2)
        lora = spec.adapter
        args = GRPOConfig(
            output_dir=tmp, max_steps=steps, learning_rate=LR, per_device_train_batch_size=PROMPTS * group,
            gradient_accumulation_steps=1, num_generations=group, max_completion_length=NEW_TOKENS,
            temperature=1.0, top_p=1.0, beta=0.0, num_iterations=1, logging_steps=1, save_strategy="no",
            report_to=[], use_cpu=True, bf16=False, fp16=False, seed=0, dataloader_num_workers=0,
            disable_tqdm=True, shuffle_dataset=False,
        )
        out: list[dict] = []
        phase: dict = {}

        class StepTimer(TrainerCallback):
            def on_step_begin(self, *a, **k):
                phase.clear()
                self.t0 = time.perf_counter()

            def on_step_end(self, *a, **k):
                step_s = time.perf_counter() - self.t0
                out.append({"step_s": step_s, "rollout_s": phase["rollout_s"], "update_s": step_s - phase["rollout_s"],
                            "positions_computed": phase["computed"], "positions_trained": phase["trained"]})
                print(f"trl G={group} step {len(out) - 1}: {step_s:.1f}s (rollout {phase['rollout_s']:.1f}) "
                      f"positions {phase['computed']}/{phase['trained']}", flush=True)

        class TimedGRPOTrainer(GRPOTrainer):
            """GRPOTrainer whose generation phase is timed and whose training batch is measured."""

            def _generate_and_score_completions(self, inputs):
                t0 = time.perf_counter()
                batch = super()._generate_and_score_completions(inputs)
                phase["rollout_s"] = time.perf_counter() - t0
                rows, width = batch["prompt_ids"].shape[0], batch["prompt_ids"].shape[1] + batch["completion_ids"].shape[1]
                phase["computed"], phase["trained"] = rows * width, int(batch["completion_mask"].sum())
                return batch

        trainer = TimedGRPOTrainer(
            model=model, reward_funcs=[correct], args=args, train_dataset=Dataset.from_list(rows), processing_class=tok,
            peft_config=LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout, target_modules=list(lora.target_modules), task_type="CAUSAL_LM"),
            callbacks=[StepTimer()],
        )
        trainer.train()
        return out


def _median(rows: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in rows[1:])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--groups", default="4,8")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "step_vs_trl"))
    args = parser.parse_args()

    import torch

    from opentinker.cli.common import quiet_libraries

    quiet_libraries()
    torch.set_num_threads(os.cpu_count() or 1)
    rows = []
    for group in [int(g) for g in args.groups.split(",")]:
        ours, trl = time_opentinker(args.steps, group), time_trl(args.steps, group)
        row = {"group": group, "opentinker": ours, "trl": trl}
        for side, steps in (("opentinker", ours), ("trl", trl)):
            row[f"{side}_median"] = {k: _median(steps, k) for k in ("step_s", "rollout_s", "update_s", "positions_computed", "positions_trained")}
        row["speedup"] = row["trl_median"]["step_s"] / row["opentinker_median"]["step_s"]
        rows.append(row)
    result = {"setting": {"model": "smollm2-135m-instruct", "prompts": PROMPTS, "max_new_tokens": NEW_TOKENS, "lora_r": LORA_R,
                          "cpus": os.cpu_count(), "steps": args.steps}, "rows": rows}
    Path(args.out + ".json").write_text(json.dumps(result, indent=2))
    lines = ["# Seconds per RL step: OpenTinker vs TRL GRPOTrainer (same work, same run)", "",
             f"SmolLM2-135M-Instruct fp32 on {os.cpu_count()} CPU cores, LoRA r{LORA_R}, {PROMPTS} prompts x G samples, "
             f"<= {NEW_TOKENS} new tokens, one optimizer step per batch; medians over steps 2..{args.steps} (step 1 is warm-up). "
             "Positions: token positions the update runs forward and backward over / those that carry loss.", "",
             "| G | side | s/step | rollout s | update s | positions computed / trained | speed-up (TRL / ours) |",
             "|---:|---|---:|---:|---:|---:|---:|"]
    for row in rows:
        for side, name in (("trl", "TRL GRPOTrainer"), ("opentinker", "OpenTinker")):
            m = row[f"{side}_median"]
            ratio = f"**{row['speedup']:.2f}x**" if side == "opentinker" else ""
            lines.append(f"| {row['group']} | {name} | {m['step_s']:.1f} | {m['rollout_s']:.1f} | {m['update_s']:.1f} "
                         f"| {m['positions_computed']:.0f} / {m['positions_trained']:.0f} | {ratio} |")
    lines += ["", "All steps (s): " + "; ".join(f"G={r['group']} {side} " + ", ".join(f"{x['step_s']:.1f}" for x in r[side])
                                                 for r in rows for side in ("trl", "opentinker")), ""]
    Path(args.out + ".md").write_text("\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
