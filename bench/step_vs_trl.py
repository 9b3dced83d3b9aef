"""Seconds per RL step: OpenTinker vs TRL's GRPOTrainer doing the same work, side by side.

Same model (SmolLM2-135M-Instruct, fp32, CPU), same LoRA (r16, alpha 32, all linear projections),
same prompts (the math conversation of examples/math_grpo.yaml), 8 prompts x 4 samples, at most
32 new tokens at T=1, one optimizer step per batch, no KL term. Each side runs `--steps` steps;
the first step of each is a warm-up and is not counted. Prints the median seconds per step of
both and the ratio TRL / OpenTinker (higher is better for OpenTinker), and writes
bench/results/step_vs_trl.{json,md}.

    python bench/step_vs_trl.py [--steps 4]
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

PROMPTS, GROUP, NEW_TOKENS, LORA_R, LR = 8, 4, 32, 16, 2e-4


def _spec(tmp: str):
    from opentinker.core.spec import load_spec

    spec = load_spec(ROOT / "examples" / "math_grpo.yaml")
    return spec.model_copy(update={
        "rollout": spec.rollout.model_copy(update={"prompts_per_step": PROMPTS, "group_size": GROUP, "max_new_tokens": NEW_TOKENS}),
        "optimization": spec.optimization.model_copy(update={"lr": LR, "micro_batch_size": PROMPTS * GROUP}),
        "checkpoint": spec.checkpoint.model_copy(update={"base_url": f"file://{tmp}"}),
    })


def time_opentinker(steps: int) -> list[float]:
    from opentinker.rl import RLJob

    with tempfile.TemporaryDirectory() as tmp:
        job = RLJob(_spec(tmp), job_id="bench-step")
        times = []
        for step in range(steps):
            t0 = time.perf_counter()
            metrics = job.rollout(step)
            job.update(step)
            times.append(time.perf_counter() - t0)
            print(f"opentinker step {step}: {times[-1]:.1f}s reward {metrics['rollout/reward_mean']:.2f}", flush=True)
    return times


def time_trl(steps: int) -> list[float]:
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from envs.math import MathGame, parse_answer
    from opentinker.env import GameEnvironment
    from opentinker.core.model_names import SMOLLM2
    from opentinker.model.policy import load_model

    with tempfile.TemporaryDirectory() as tmp:
        spec = _spec(tmp)
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
            output_dir=tmp, max_steps=steps, learning_rate=LR, per_device_train_batch_size=PROMPTS * GROUP,
            gradient_accumulation_steps=1, num_generations=GROUP, max_completion_length=NEW_TOKENS,
            temperature=1.0, top_p=1.0, beta=0.0, num_iterations=1, logging_steps=1, save_strategy="no",
            report_to=[], use_cpu=True, bf16=False, fp16=False, seed=0, dataloader_num_workers=0,
            disable_tqdm=True, shuffle_dataset=False,
        )
        times: list[float] = []

        class StepTimer(TrainerCallback):
            def on_step_begin(self, *a, **k):
                self.t0 = time.perf_counter()

            def on_step_end(self, *a, **k):
                times.append(time.perf_counter() - self.t0)
                print(f"trl step {len(times) - 1}: {times[-1]:.1f}s", flush=True)

        trainer = GRPOTrainer(
            model=model, reward_funcs=[correct], args=args, train_dataset=Dataset.from_list(rows), processing_class=tok,
            peft_config=LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout, target_modules=list(lora.target_modules), task_type="CAUSAL_LM"),
            callbacks=[StepTimer()],
        )
        trainer.train()
        return times


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "step_vs_trl"))
    args = parser.parse_args()

    import torch

    from opentinker.cli.common import quiet_libraries

    quiet_libraries()
    torch.set_num_threads(os.cpu_count() or 1)
    ours = time_opentinker(args.steps)
    trl = time_trl(args.steps)
    ours_med, trl_med = statistics.median(ours[1:]), statistics.median(trl[1:])
    ratio = trl_med / ours_med
    result = {
        "setting": {"model": "smollm2-135m-instruct", "prompts": PROMPTS, "group": GROUP, "max_new_tokens": NEW_TOKENS, "lora_r": LORA_R, "cpus": os.cpu_count()},
        "opentinker_step_seconds": ours, "trl_step_seconds": trl,
        "opentinker_median_s": ours_med, "trl_median_s": trl_med, "speedup_trl_over_opentinker": ratio,
    }
    Path(args.out + ".json").write_text(json.dumps(result, indent=2))
    md = (
        "# Seconds per RL step: OpenTinker vs TRL GRPOTrainer (same work, same run)\n\n"
        f"SmolLM2-135M-Instruct fp32 on {os.cpu_count()} CPU cores, LoRA r{LORA_R}, {PROMPTS} prompts x {GROUP} samples, "
        f"<= {NEW_TOKENS} new tokens, one optimizer step per batch; median over steps 2..{args.steps} (step 1 is warm-up).\n\n"
        "| | median s/step | all steps |\n|---|---:|---|\n"
        f"| TRL GRPOTrainer | {trl_med:.1f} | {', '.join(f'{t:.1f}' for t in trl)} |\n"
        f"| OpenTinker | {ours_med:.1f} | {', '.join(f'{t:.1f}' for t in ours)} |\n\n"
        f"**Speed-up: {ratio:.2f}x** (TRL / OpenTinker; target >= 1.5x)\n"
    )
    Path(args.out + ".md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
