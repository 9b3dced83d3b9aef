"""The native math learning run (bench/learning_math.py), written with the Tinker SDK alone, on this CPU.

What it measures: whether the unmodified `tinker` SDK, pointed at OpenTinker's gateway, learns what
the native RL job learns from the same settings. The loop is the one a Tinker user writes, each
step: `save_weights_and_get_sampling_client()`, sample a group of completions per prompt, reward
them with the game (envs/math, the class itself), GRPO advantages, Datums, `forward_backward`
("importance_sampling", or "ppo" with --loss), `optim_step`. Every --every steps (and at step 0
and the end) the greedy accuracy (temperature 0, one sample) on the native bench's held-out
problems. The gateway and its Tinker sessions run in this process (opentinker.control.gateway.
tinker_local), over HTTP as the stack serves them.

Everything that sets the run comes from examples/math_grpo.yaml, the native bench's spec: the
task stream and held-out set (GameEnvironment with the spec's env config and seed: the same
training problems in the same order, the same 64 held-out problems), the prompt (system prompt,
one example turn, the question; rendered with the tokenizer's chat template exactly as the agent
loop renders it), prompts x group size, max new tokens, temperature, top_p, the stop token (EOS),
the LoRA (rank 16, alpha 32, attention + MLP, no unembedding, seed 0), GRPO with the group std,
PPO's clip range, AdamW (lr 2e-4, torch's betas 0.9/0.999 and eps 1e-8, no weight decay,
gradient clipped at norm 1.0) and the token-mean aggregation: Tinker's losses are sums over tokens,
so each advantage is divided by the batch's number of sampled tokens, which gives the native
loss's gradient. Target, as the native bench's: greedy held-out accuracy >= 75% and >= 30 points
above step 0 within 25 steps.

Temperature: Tinker's losses score log p at temperature 1 (the API carries no temperature), so
with samples drawn at T=0.7 the sampler's logprobs make every importance ratio p1/p0.7 (high
variance: 57.8% at step 25 in one run). `--recompute-logprobs` passes instead the policy's own
temperature-1 logprobs of each completion (`compute_logprobs`, as the cookbook's issue #396
suggests), so the ratio is 1 and the update is the temperature-1 policy gradient on samples drawn
at 0.7: off-policy by the temperature, stated, not corrected. `--temperature`/`--lr` override the spec.

    python bench/learning_tinker.py --recompute-logprobs   # the run the docs quote
    python bench/learning_tinker.py [--model smollm2-135m-instruct] [--steps 25] [--every 5] [--loss importance_sampling|ppo] [--eval-n 64] [--temperature T] [--lr LR]
writes bench/results/learning_tinker.json and bench/results/learning_tinker.md (beside the
native curve of bench/results/learning_math.json when it is there)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

TARGET = {"accuracy": 0.75, "gain": 0.30}  # as bench/learning_math.py's "rl" recipe
SPEC = ROOT / "examples" / "math_grpo.yaml"
NATIVE = ROOT / "bench" / "results" / "learning_math.json"
BEHAVIOUR = {False: "the sampler's (softmax(logits / T) of each drawn token)",
             True: "the policy's own at temperature 1 (`compute_logprobs` on the sampler, after sampling)"}
TINKER_LORA_ALPHA = 32.0  # Tinker's LoRA alpha (not on the wire)
TINKER_LORA_MODULES = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}  # train_attn + train_mlp


def prompt_tokens(tokenizer, game, task: dict[str, Any]) -> list[int]:
    """The episode's opening as the native agent loop tokenizes it (opentinker/env/messages.py,
    opentinker/agent/chat.py): system prompt, the game's example turns, the question as the user
    message; the chat template's text with the generation prompt, encoded without special tokens."""
    question = game.reset(**task)
    messages = [{"role": "system", "content": game.get_system_prompt()}] if game.get_system_prompt() else []
    messages += game.get_example_turns()
    messages.append({"role": "user", "content": "\n\n".join(x for x in (game.get_initial_user_message(), question) if x)})
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def advantages(rewards: list[float], group_size: int, algorithm) -> list[float]:
    """One advantage per sample, groups of `group_size` consecutive samples: GRPO (reward minus the
    group mean, over the group's unbiased std + 1e-6 when `normalize_std`) or RLOO, as the native
    trainer computes them (opentinker/algo/advantages.py)."""
    out = []
    for start in range(0, len(rewards), group_size):
        group = rewards[start : start + group_size]
        mean = sum(group) / len(group)
        if algorithm.advantage == "rloo":
            out += [(r - (sum(group) - r) / (len(group) - 1)) for r in group]
        elif algorithm.normalize_std:
            std = statistics.stdev(group) if len(group) > 1 else 0.0
            out += [(r - mean) / (std + 1e-6) for r in group]
        else:
            out += [r - mean for r in group]
    return out


def episode_metrics(outcomes: list[dict[str, Any]], prefix: str) -> dict[str, float]:
    """Reward, accuracy, format rate and share of distinct answers, as the native job reports them
    (opentinker/tracking/metrics.py)."""
    n = max(len(outcomes), 1)
    answers = [repr(o["info"]["answer"]) for o in outcomes]
    return {f"{prefix}/reward_mean": sum(o["reward"] for o in outcomes) / n,
            f"{prefix}/accuracy": sum(bool(o["info"]["correct"]) for o in outcomes) / n,
            f"{prefix}/format_ok": sum(bool(o["info"]["format_ok"]) for o in outcomes) / n,
            f"{prefix}/distinct_answer_share": len(set(answers)) / max(len(answers), 1),
            f"{prefix}/response_tokens_mean": sum(len(o["tokens"]) for o in outcomes) / n}


class Run:
    """The Tinker side: one LoRA training client and the sampler of its current weights."""

    def __init__(self, spec, model: str, loss: str, recompute: bool = False):
        import tinker
        from tinker import types

        self.tinker, self.types, self.spec, self.loss, self.recompute = tinker, types, spec, loss, recompute
        self.service = tinker.ServiceClient()
        self.trainer = self.service.create_lora_training_client(
            base_model=model, rank=spec.adapter.r, seed=spec.seed, train_attn=True, train_mlp=True, train_unembed=False).result()
        self.tokenizer = self.trainer.get_tokenizer()
        self.stop = [self.tokenizer.eos_token_id]  # <|im_end|>: the chat template's end of turn (the native engine's stop ids)
        self._sampler = None  # the sampler of the weights as they are now (None: they changed since)

    def sampler(self):
        if self._sampler is None:
            self._sampler = self.trainer.save_weights_and_get_sampling_client().result()
        return self._sampler

    def play(self, env, tasks: list[dict[str, Any]], samples: int, temperature: float) -> list[dict[str, Any]]:
        """`samples` completions of each task's prompt (all requests in flight together), each
        rewarded by a fresh game: per completion its prompt, tokens, sampler logprobs, reward, info."""
        r = self.spec.rollout
        params = self.types.SamplingParams(max_tokens=r.max_new_tokens, temperature=temperature, top_p=r.top_p, stop=self.stop)
        sampler = self.sampler()
        prompts = [prompt_tokens(self.tokenizer, env.make_game(), task) for task in tasks]
        futures = [sampler.sample(self.types.ModelInput.from_ints(p), num_samples=samples, sampling_params=params) for p in prompts]
        outcomes = []
        rescored = []  # the policy's own (temperature 1) logprobs of each completion, when asked for
        if self.recompute and samples > 1:
            rescored = [sampler.compute_logprobs(self.types.ModelInput.from_ints(p + list(seq.tokens)))
                        for p, f in zip(prompts, futures) for seq in f.result().sequences]
        k = 0
        for task, prompt, future in zip(tasks, prompts, futures):
            for seq in future.result().sequences:
                game = env.make_game()
                game.reset(**task)
                result = game.step(self.tokenizer.decode(seq.tokens, skip_special_tokens=True))
                logprobs = list(seq.logprobs or [])
                if rescored:
                    logprobs = [float(x) for x in rescored[k].result()[len(prompt):]]
                k += 1
                outcomes.append({"task": task, "prompt": prompt, "tokens": list(seq.tokens), "logprobs": logprobs,
                                 "reward": float(result.reward), "info": result.info,
                                 "text": self.tokenizer.decode(seq.tokens, skip_special_tokens=True)})
        return outcomes

    def datums(self, outcomes: list[dict[str, Any]]) -> list[Any]:
        """One Datum per completion: input prompt + completion[:-1], targets shifted by one, the
        sampler's logprobs and the advantage on completion positions (0 on the prompt). The
        advantages are scaled so that Tinker's summed loss is the native loss's mean."""
        a = self.spec.algorithm
        advs = advantages([o["reward"] for o in outcomes], self.spec.rollout.group_size, a)
        if a.loss_aggregation == "token-mean":  # every sampled token of the batch weighs the same
            scales = [1.0 / sum(len(o["tokens"]) for o in outcomes)] * len(outcomes)
        else:  # seq-mean: every sequence weighs the same
            scales = [1.0 / (len(o["tokens"]) * len(outcomes)) for o in outcomes]
        data = []
        for o, adv, scale in zip(outcomes, advs, scales):
            tokens, n_prompt, n = o["prompt"] + o["tokens"], len(o["prompt"]), len(o["tokens"])
            if len(o["logprobs"]) != n:
                raise RuntimeError(f"the sampler gave {len(o['logprobs'])} logprobs for {n} tokens")
            data.append(self.types.Datum(
                model_input=self.types.ModelInput.from_ints(tokens[:-1]),
                loss_fn_inputs={"target_tokens": tokens[1:],
                                "logprobs": [0.0] * (n_prompt - 1) + o["logprobs"],
                                "advantages": [0.0] * (n_prompt - 1) + [adv * scale] * n}))
        return data

    def train(self, outcomes: list[dict[str, Any]]) -> dict[str, float]:
        """forward_backward on the batch (every completion, zero-advantage groups too, as the
        native update does) and one AdamW step with the native optimizer's settings."""
        o = self.spec.optimization
        config = None
        if self.loss == "ppo":
            clip = self.spec.algorithm.clip_range
            config = {"clip_low_threshold": 1.0 - clip, "clip_high_threshold": 1.0 + clip}
        fb = self.trainer.forward_backward(self.datums(outcomes), self.loss, loss_fn_config=config)
        step = self.trainer.optim_step(self.types.AdamParams(
            learning_rate=o.lr, beta1=0.9, beta2=0.999, eps=1e-8,  # torch.optim.AdamW's defaults, as the native trainer's
            weight_decay=o.weight_decay, grad_clip_norm=o.grad_clip))
        fb_out, step_out = fb.result(), step.result()
        self._sampler = None
        return {"update/loss_sum": float(fb_out.metrics.get("loss:sum", 0.0)),
                "update/grad_norm": float(step_out.metrics.get("grad_norm:mean", 0.0)) if step_out.metrics else 0.0}

    def evaluate(self, env, step: int, n: int) -> SimpleNamespace:
        """Greedy (temperature 0), one sample per held-out problem."""
        temperature = 0.0 if self.spec.evaluation.greedy else self.spec.rollout.temperature
        outcomes = self.play(env, env.validation_tasks(n), 1, temperature)
        return SimpleNamespace(step=step, metrics=episode_metrics(outcomes, "eval"), outcomes=outcomes)


def check_matchable(spec) -> None:
    """What the SDK cannot express stops the run instead of quietly comparing different settings."""
    a = spec.adapter
    problems = []
    if a.kind != "lora" or a.alpha != TINKER_LORA_ALPHA or a.dropout or set(a.target_modules) != TINKER_LORA_MODULES:
        problems.append(f"adapter {a.model_dump()}: Tinker's LoRA has alpha {TINKER_LORA_ALPHA:g}, no dropout, attention and/or MLP")
    if spec.algorithm.kl.coef > 0:
        problems.append("algorithm.kl.coef > 0: the KL penalty would go into the advantages, which this bench does not do")
    if spec.rollout.max_turns != 1:
        problems.append("rollout.max_turns != 1: this bench plays single-turn episodes")
    if problems:
        raise SystemExit(f"{SPEC.name} has settings this bench does not reproduce:\n  " + "\n  ".join(problems))


def native_curve() -> dict[str, Any] | None:
    if not NATIVE.exists():
        return None
    data = json.loads(NATIVE.read_text())
    return {"curve": [{k: c.get(k) for k in ("step", "greedy_accuracy", "sampled_train_reward", "wall_seconds")} for c in data["curve"]],
            "wall_seconds": data.get("wall_seconds"), "median_step_seconds": data.get("median_step_seconds"),
            "machine": data.get("machine"), "model": data.get("spec", {}).get("model", {}).get("name")}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="the base model (default: the spec's, smollm2-135m-instruct)")
    parser.add_argument("--steps", type=int, default=25)
    parser.add_argument("--every", type=int, default=5)
    parser.add_argument("--loss", choices=["importance_sampling", "ppo"], default="importance_sampling")
    parser.add_argument("--eval-n", type=int, default=None, help="held-out problems per evaluation (default: the spec's, 64)")
    parser.add_argument("--temperature", type=float, default=None, help="sampling temperature (default: the spec's)")
    parser.add_argument("--lr", type=float, default=None, help="AdamW learning rate (default: the spec's)")
    parser.add_argument("--recompute-logprobs", action="store_true",
                        help="pass the sampler's compute_logprobs (temperature 1) as the behaviour logprobs, not the sampled ones")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "learning_tinker"))
    args = parser.parse_args()

    import torch

    from bench.progress import eval_line, step_line
    from opentinker.cli.common import quiet_libraries
    from opentinker.core.spec import load_spec
    from opentinker.env import GameEnvironment, import_game

    quiet_libraries()
    torch.set_num_threads(os.cpu_count() or 1)  # the Tinker sessions run in this process
    spec = load_spec(SPEC)
    if args.temperature is not None or args.lr is not None:  # stated in the results' header, never silent
        spec = spec.model_copy(update={
            "rollout": spec.rollout.model_copy(update={"temperature": args.temperature if args.temperature is not None else spec.rollout.temperature}),
            "optimization": spec.optimization.model_copy(update={"lr": args.lr if args.lr is not None else spec.optimization.lr})})
    check_matchable(spec)
    model = args.model or spec.model.name
    eval_n = args.eval_n or spec.evaluation.n_samples
    P, G = spec.rollout.prompts_per_step, spec.rollout.group_size
    env = GameEnvironment(import_game(spec.env.game), spec)  # the native job's task stream and held-out set (same seed)

    from opentinker.control.gateway.tinker_local import local_gateway

    with tempfile.TemporaryDirectory() as tmp:
        url, keys, sessions, server = local_gateway(Path(tmp))
        os.environ.update(TINKER_BASE_URL=url, TINKER_API_KEY=keys["alice"], TINKER_TELEMETRY="0")
        try:
            t0 = time.perf_counter()
            run = Run(spec, model, args.loss, args.recompute_logprobs)
            load_s = time.perf_counter() - t0
            t_run = time.perf_counter()
            evaluations, steps = [], []

            def evaluate(done: int) -> SimpleNamespace:
                ev = run.evaluate(env, done, eval_n)
                ev.wall_seconds = time.perf_counter() - t_run
                evaluations.append(ev)
                print(eval_line(ev), flush=True)
                return ev

            evaluate(0)
            for step in range(args.steps):
                done, t_step = step + 1, time.perf_counter()
                outcomes = run.play(env, env.train_tasks(P), G, spec.rollout.temperature)
                metrics = episode_metrics(outcomes, "rollout") | {"rollout/seconds": time.perf_counter() - t_step}
                metrics |= run.train(outcomes)
                if done == args.steps or (args.every > 0 and done % args.every == 0):
                    evaluate(done)
                metrics["step/seconds"] = time.perf_counter() - t_step
                steps.append({"step": done, **metrics})
                print(step_line(SimpleNamespace(step=done, metrics=metrics)), flush=True)
            wall = time.perf_counter() - t_run
            run.service.close("success").result()
        finally:
            server.stop()
            sessions.close()

    sampled = {s["step"]: s["rollout/reward_mean"] for s in steps}
    curve = [{"step": ev.step,
              "greedy_accuracy": ev.metrics["eval/accuracy"],
              "greedy_reward": ev.metrics["eval/reward_mean"],
              "format_rate": ev.metrics["eval/format_ok"],
              "distinct_answer_share": ev.metrics["eval/distinct_answer_share"],
              "sampled_train_reward": sampled.get(ev.step),
              "wall_seconds": ev.wall_seconds,
              "examples": [(o["task"]["question"], o["text"]) for o in ev.outcomes[:3]]} for ev in evaluations]
    first = curve[0]["greedy_accuracy"]
    reached = [c for c in curve if c["greedy_accuracy"] >= TARGET["accuracy"] and c["greedy_accuracy"] >= first + TARGET["gain"]]
    step_times = sorted(s["step/seconds"] for s in steps)
    native = native_curve()
    out = {
        "model": model,
        "loss": args.loss,
        "behaviour_logprobs": BEHAVIOUR[args.recompute_logprobs],
        "spec": spec.model_dump(mode="json"),
        "tinker_settings": {"lora": {"rank": spec.adapter.r, "alpha": TINKER_LORA_ALPHA, "seed": spec.seed, "train_attn": True,
                                     "train_mlp": True, "train_unembed": False},
                            "adam": {"learning_rate": spec.optimization.lr, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8,
                                     "weight_decay": spec.optimization.weight_decay, "grad_clip_norm": spec.optimization.grad_clip},
                            "sampling": {"max_tokens": spec.rollout.max_new_tokens, "temperature": spec.rollout.temperature,
                                         "top_p": spec.rollout.top_p, "stop": run.stop},
                            "prompts_per_step": P, "group_size": G, "eval_n": eval_n,
                            "advantage_scale": spec.algorithm.loss_aggregation},
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__},
        "model_load_seconds": load_s,
        "wall_seconds": wall,
        "median_step_seconds": step_times[len(step_times) // 2] if step_times else None,
        "steps": steps,
        "curve": curve,
        "target": TARGET,
        "target_met": bool(reached),
        "target_met_at_step": reached[0]["step"] if reached else None,
        "wall_seconds_to_target": reached[0]["wall_seconds"] if reached else None,
        "native": native,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out + ".json").write_text(json.dumps(out, indent=2))

    native_at = {c["step"]: c for c in native["curve"]} if native else {}
    lines = [
        f"# Learning curve through the Tinker SDK: {model}, 1..20 addition, LoRA r{spec.adapter.r} + GRPO (CPU)",
        "",
        (f"The native run's settings ({SPEC.relative_to(ROOT)}) driven by the unmodified `tinker` SDK: {args.steps} steps of "
         f"{P} prompts x {G} samples, {spec.rollout.max_new_tokens} new tokens, T={spec.rollout.temperature:g}; "
         f"loss `{args.loss}`, AdamW lr {spec.optimization.lr:g}; greedy evaluation on {eval_n} held-out problems. "
         f"Behaviour logprobs: {BEHAVIOUR[args.recompute_logprobs]}."),
        (f"Wall time {wall:.0f} s (median step {out['median_step_seconds'] or 0:.1f} s, evaluations included), "
         f"model load {load_s:.0f} s, {os.cpu_count()} CPUs."),
    ]
    if native:
        lines.append(f"Native: bench/results/learning_math.json ({native['model']}, wall {native['wall_seconds'] or 0:.0f} s, "
                     f"median step {native['median_step_seconds'] or 0:.1f} s, {(native['machine'] or {}).get('cpus')} CPUs).")
    lines += ["",
              ("| step | greedy accuracy (Tinker SDK) | greedy accuracy (native) | sampled train reward (Tinker SDK) "
               "| sampled train reward (native) | format rate (Tinker SDK) | distinct answers (Tinker SDK) | wall s (Tinker SDK) | wall s (native) |"),
              "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]

    def pct(x):
        return "-" if x is None else f"{x:.1%}"

    def num(x, fmt):
        return "-" if x is None else format(x, fmt)

    mine = {c["step"]: c for c in curve}
    for step in sorted(set(mine) | set(native_at)):
        c, n = mine.get(step, {}), native_at.get(step, {})
        lines.append(f"| {step} | {pct(c.get('greedy_accuracy'))} | {pct(n.get('greedy_accuracy'))} "
                     f"| {num(c.get('sampled_train_reward'), '.3f')} | {num(n.get('sampled_train_reward'), '.3f')} "
                     f"| {pct(c.get('format_rate'))} | {pct(c.get('distinct_answer_share'))} "
                     f"| {num(c.get('wall_seconds'), '.0f')} | {num(n.get('wall_seconds'), '.0f')} |")
    goal = f">= {TARGET['accuracy']:.0%} and >= +{TARGET['gain'] * 100:.0f} points over step 0 within {args.steps} steps"
    lines += ["", f"Target ({goal}): " + (f"met at step {out['target_met_at_step']}, {out['wall_seconds_to_target']:.0f} s of wall time"
                                          if reached else "NOT met"), ""]
    Path(args.out + ".md").write_text("\n".join(lines))
    print("\n".join(lines))
    print(f"step-0 accuracy {first:.1%} -> final {curve[-1]['greedy_accuracy']:.1%}")
    return 0 if reached else 1


if __name__ == "__main__":
    sys.exit(main())
