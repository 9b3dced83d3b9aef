"""Diagnostic for the VLM learning check (not a benchmark): the RL loss on exhaustive groups.

Each step draws the step's pictures through the job's own sampler, then replaces every group by
the four answers to its picture in the game's reply format (`Answer: A`..`Answer: D`, or the four
choice words with `reply: word`; the game's own reward, 1 for the right one, so GRPO gives +1.5 / -0.5 with no
sampling noise), with their logprobs recomputed under the current
policy (ratio 1), and takes one optimizer step on them. Greedy held-out accuracy, format rate and
answer diversity are printed every `--every` steps, with a few greedy replies. It separates the
trainer's path through the picture from exploration: if this does not learn, sampling is not
the problem.

    python bench/vlm_oracle.py [--spec examples/vlm_shapes.yaml] [--steps 10] [--every 5]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

LETTERS = "ABCD"


def answers(task: dict, game) -> list[str]:
    """The four answers to a shapes/geometry task, written as the game wants them."""
    if getattr(game, "reply", "letter") == "word":
        return list(task["choices"])
    return [f"Answer: {letter}" for letter in LETTERS]


def exhaustive_groups(trajs, tokenizer, make_game) -> list:
    """Per group, its first record's prompt answered with each of the four answers (and the
    sampled reply's last token, the end of the turn), each rewarded by the game itself."""
    from opentinker.core.trajectory import Trajectory

    firsts: dict[int, object] = {}
    for t in trajs:
        firsts.setdefault(t.group_id, t)
    out = []
    game = make_game()
    for group, t in firsts.items():
        turn = t.turns[0]
        end_of_turn = t.token_ids[turn.sampled_end - 1]
        for text in answers(t.task, game):
            game.reset(**t.task)
            ids = tokenizer.encode(text, add_special_tokens=False) + [end_of_turn]
            new = Trajectory(prompt_ids=t.prompt_ids, group_id=group, policy_version=t.policy_version,
                             token_ids=list(t.token_ids[:turn.sampled_start]), loss_mask=list(t.loss_mask[:turn.sampled_start]),
                             sampling_logprobs=list(t.sampling_logprobs[:turn.sampled_start]), images=t.images, task=t.task)
            new.append_sampled(ids, [0.0] * len(ids), text)
            new.turns[-1].reward = game.step(text).reward
            out.append(new)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spec", default=str(ROOT / "examples" / "vlm_shapes.yaml"))
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--every", type=int, default=5)
    args = parser.parse_args()

    import torch

    from bench.progress import eval_line
    from opentinker.cli.common import quiet_libraries
    from opentinker.core.spec import load_spec
    from opentinker.rl import RLJob

    quiet_libraries()
    torch.set_num_threads(os.cpu_count() or 1)
    spec = load_spec(args.spec)
    with tempfile.TemporaryDirectory() as tmp:
        spec = spec.model_copy(update={"checkpoint": spec.checkpoint.model_copy(update={"every": 0, "base_url": f"file://{tmp}"})})
        job = RLJob(spec, job_id="vlm-oracle")
        trainer, tokenizer = job.policy.trainer, job.policy.tokenizer

        def evaluate(step: int) -> None:
            ev = job.evaluate(step)
            print(f"{eval_line(ev)} replies {[t['messages'][-1]['content'] for t in ev.transcripts[:3]]}", flush=True)

        evaluate(0)
        for step in range(1, args.steps + 1):
            t0 = time.perf_counter()
            job.rollout(step)
            groups = exhaustive_groups(job.sampler.batch(step).trajectories, tokenizer, job.sampler.env.make_game)
            for t, lp in zip(groups, trainer.logprobs(groups)):
                t.sampling_logprobs[t.turns[-1].sampled_start:] = lp
            metrics = trainer.update(groups)
            job.sampler.sync(trainer.version)
            print(f"step {step}: {time.perf_counter() - t0:.1f}s grad norm {metrics['update/grad_norm']:.3f}", flush=True)
            if step % args.every == 0:
                evaluate(step)
    return 0


if __name__ == "__main__":
    sys.exit(main())
