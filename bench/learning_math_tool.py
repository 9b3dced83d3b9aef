"""Learning curve of SmolLM2-135M-Instruct using a calculator tool (LoRA r16 + GRPO), on this CPU.

Setting (examples/math_tool_grpo.yaml, envs.math_tool:MathToolGame): the calculator is a declared
tool, shown in SmolLM2's prompt in the hermes default format (its own template renders no tools;
opentinker/tools/formats.py, docs/tools.md): a call is a `<tool_call>{"name": "calculator",
"arguments": {"expression": ...}}</tool_call>` block, answered by the agent loop with a `tool`
message the model reads as `<tool_response>VALUE</tool_response>`; the final answer is
'Answer: <number>'. One example conversation (17 * 23 through the calculator) precedes the
question. The questions are products of two 2-digit numbers, "What is 47 * 83?", which a 135M
model cannot work out in its head, so accuracy needs the tool: call it with the right expression,
then copy the result into the answer. Reward 1 for a correct answer, 0 otherwise (no tool bonus).
Up to 3 calls (max_tool_calls), 4 turns, the spec's new tokens a turn.

Held-out: `--eval-n` products (and their commuted twins) never drawn for training, evaluated
greedily before training and every `--every` steps: answer accuracy, tool-call rate (episodes with
>= 1 call), tool-call success rate (tool attempts that got a result back / tool attempts, where an
attempt is an assistant turn that writes `<tool_call` and a result is a tool answer that is not an
`error:`), the share of episodes that got a result, tool error rate (calls malformed or refused /
calls, the agent loop's `tool_errors` / `tool_calls`), format rate (episodes that ended with
'Answer: N'), and the share of answers that copy the last tool result. The same tool counts are
taken on every step's sampled training rollouts (temperature 1), a curve with a point per step.

The published results (bench/results/learning_math_tool.*) predate the declared-tool format: they
were measured when the calculator was written <calc>EXPRESSION</calc> and answered
<result>VALUE</result> in the next user turn, and the observations below are of that format.
Observed then in a 1-step smoke run: before training SmolLM2 greedily wrote the calculator's
*reply* tag, '<result>61 * 29</result>' or '<result>102</result>', instead of a call; the game
counted that as neither a call nor an answer (reward 0, format 0), so step 0 read 0% on every
column. Sampled at T=1 about a third of the episodes did call the tool, and one GRPO step made the
greedy policy call it and copy the result on all 16 held-out products: on plain 'What is a * b?'
questions the curve saturated early (see --phrasing for harder variants).

    python bench/learning_math_tool.py [--steps 15] [--every 5] [--eval-n 64] [--phrasing plain|word|mixed]
    python bench/learning_math_tool.py --model tiny-random --steps 1 --every 1 --eval-n 4 --out /tmp/smoke
writes bench/results/learning_math_tool.json and bench/results/learning_math_tool.md (or --out)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

_RESULT_RE = re.compile(r"<tool_response>\n?(.*?)\n?</tool_response>", re.DOTALL)  # a tool answer inside a rendered user turn
_ATTEMPT_RE = re.compile(r"<tool_call")


def product_tasks(seed: int, n_val: int, low: int = 10, high: int = 99, phrasing: str = "plain") -> tuple[list[dict], list[dict]]:
    """(train, validation): 'What is a * b?' for a, b in [low, high]; a held-out pair is held out
    in both orders, so training never sees b * a of a validation a * b. `phrasing` "word" asks
    the same product as the game's word problem ("A box holds a rows of b apples. ..."), "mixed"
    either way at random (fixed per pair)."""
    import numpy as np

    from envs.math_tool.game import WORD_PROBLEMS

    word = next(text for ops, text, _ in WORD_PROBLEMS if ops == "*")
    wordy = np.random.default_rng([seed, 77]).random((high + 1, high + 1)) < {"plain": 0.0, "word": 1.1, "mixed": 0.5}[phrasing]

    pairs = [(a, b) for a in range(low, high + 1) for b in range(low, high + 1)]
    order = np.random.default_rng([seed, 2024]).permutation(len(pairs))
    val, held = [], set()
    for i in order:
        a, b = pairs[i]
        if len(val) == n_val:
            break
        if (a, b) not in held:
            val.append((a, b))
            held |= {(a, b), (b, a)}
    train = [pairs[i] for i in order if pairs[i] not in held]

    def task(a: int, b: int) -> dict:
        question = word.format(a=a, b=b) if wordy[a, b] else f"What is {a} * {b}?"
        return {"question": question, "answer": a * b}

    return [task(a, b) for a, b in train], [task(a, b) for a, b in val]


def _saved(tasks: list[dict], path: str) -> str:
    """The tasks as a JSONL file (a spec holds at most 256 KB: the training products go by path)."""
    from opentinker.env.environment import save_dataset

    save_dataset(tasks, path)
    return path


def tool_summary(transcripts: list[dict]) -> dict:
    """Counts over evaluation episodes, straight from each episode's final info and messages."""
    n = len(transcripts) or 1
    infos = [t["info"] for t in transcripts]
    calls = sum(int(i.get("tool_calls", 0)) for i in infos)
    errors = sum(int(i.get("tool_errors", 0)) for i in infos)
    attempts = succeeded = copied = answered_after_result = got_result = 0
    for t in transcripts:
        results = []
        for attempt, answers in _attempts(_episode(t)):
            good = [a for a in answers if not a.startswith("error:")]
            attempts += attempt
            succeeded += attempt and bool(good)
            results += good
        got_result += bool(results)
        answer = t["info"].get("answer")
        if results and answer is not None:
            answered_after_result += 1
            copied += str(answer) == results[-1]
    return {
        "accuracy": sum(bool(i.get("correct")) for i in infos) / n,
        "tool_call_rate": sum(int(i.get("tool_calls", 0)) > 0 for i in infos) / n,
        "tool_calls_per_episode": calls / n,
        "tool_success_rate": succeeded / attempts if attempts else None,
        "episodes_with_result": got_result / n,
        "tool_error_rate": errors / calls if calls else 0.0,
        "format_rate": sum(bool(i.get("format_ok")) for i in infos) / n,
        "copies_result_rate": copied / answered_after_result if answered_after_result else None,
        "attempts": attempts,
        "succeeded": succeeded,
        "calls": calls,
        "errors": errors,
    }


def _tool_answers(message: dict) -> list[str]:
    """The tool answers a message carries: a `tool` message's content (how the agent loop records
    them), or the `<tool_response>` blocks of a user turn (a transcript of the rendered text)."""
    content = message["content"] if isinstance(message.get("content"), str) else ""
    if message["role"] == "tool":
        return [content.strip()]
    if message["role"] == "user":
        return [r.strip() for r in _RESULT_RE.findall(content)]
    return []


def _attempts(messages: list[dict]) -> list[tuple[bool, list[str]]]:
    """Each assistant turn of the episode: whether it tried a call, and the tool answers that followed it."""
    turns: list[tuple[bool, list[str]]] = []
    for m in messages:
        if m["role"] == "assistant":
            turns.append((bool(_ATTEMPT_RE.search(m["content"] if isinstance(m.get("content"), str) else "")), []))
        elif turns:
            turns[-1][1].extend(_tool_answers(m))
    return turns


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.1%}"


def _episode(t: dict) -> list[dict]:
    """The episode's own messages, from its question on (after the system prompt and the example
    conversation, whose calculator answer 391 must not count)."""
    msgs = t["messages"]
    starts = [i for i, m in enumerate(msgs) if m["role"] == "user" and t["task"]["question"] in m["content"]]
    return msgs[starts[-1]:] if starts else msgs


def _as_transcripts(trajs) -> list[dict]:
    return [{"info": t.info, "messages": t.messages, "task": t.task} for t in trajs if not t.failed]


def _example(t: dict) -> list[str]:
    return [f"{m['role']}: {str(m['content']).rstrip() or repr(m['content'])}" for m in _episode(t)]


_TABLE_HEAD = ("| step | accuracy | tool-call success | episodes with a result | tool-call rate | tool error rate | "
               "calls / episode | format rate | answer copies last result |")


def _row(step: int, c: dict, reward: bool = False) -> str:
    last = f"{c['reward_mean']:.3f}" if reward else _pct(c["copies_result_rate"])
    return (f"| {step} | {c['accuracy']:.1%} | {_pct(c['tool_success_rate'])} ({c['succeeded']}/{c['attempts']}) | "
            f"{c['episodes_with_result']:.1%} | {c['tool_call_rate']:.1%} | {c['tool_error_rate']:.1%} | "
            f"{c['tool_calls_per_episode']:.2f} | {c['format_rate']:.1%} | {last} |")


def _pooled(points: list[dict]) -> float | None:
    """Successful attempts / attempts over several steps (each step is only 32 episodes)."""
    attempts = sum(p["attempts"] for p in points)
    return sum(p["succeeded"] for p in points) / attempts if attempts else None


def _mean(points: list[dict], key: str) -> float:
    return sum(p[key] for p in points) / len(points)


def _trend(name: str, first: float | None, last: float | None) -> str:
    if first is None or last is None:
        return f"{name} {_pct(first)} -> {_pct(last)} (n/a where no call was made)"
    diff = last - first
    word = "rose" if diff > 0 else ("fell" if diff < 0 else "unchanged")
    return f"{name} {first:.1%} -> {last:.1%} ({word}, {diff * 100:+.1f} pts)"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--every", type=int, default=5)
    parser.add_argument("--eval-n", type=int, default=64, help="held-out problems per evaluation")
    parser.add_argument("--prompts", type=int, default=8, help="prompts per step")
    parser.add_argument("--group", type=int, default=4, help="samples per prompt")
    parser.add_argument("--model", default="smollm2-135m-instruct", help="e.g. tiny-random for a smoke run")
    parser.add_argument("--phrasing", choices=["plain", "word", "mixed"], default="plain",
                        help="'What is a * b?', the word problem 'A box holds a rows of b apples...', or half each")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--spec", default=str(ROOT / "examples" / "math_tool_grpo.yaml"))
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "learning_math_tool"))
    args = parser.parse_args()

    import torch

    from opentinker.cli.common import quiet_libraries
    from opentinker.rl import RLJob
    from opentinker.core.spec import load_spec, parse_spec

    quiet_libraries()
    torch.set_num_threads(os.cpu_count() or 1)
    train, val = product_tasks(args.seed, args.eval_n, phrasing=args.phrasing)
    base = load_spec(args.spec).model_dump(mode="json")
    with tempfile.TemporaryDirectory() as tmp:
        data = base | {
            "model": base["model"] | {"name": args.model},
            "rollout": base["rollout"] | {"prompts_per_step": args.prompts, "group_size": args.group},
            "optimization": base["optimization"] | {"steps": args.steps},
            "evaluation": base["evaluation"] | {"every": args.every, "n_samples": args.eval_n, "greedy": True},
            "checkpoint": base["checkpoint"] | {"every": 0, "base_url": f"file://{tmp}"},
            "env": {"game": "envs.math_tool:MathToolGame",
                    "config": {"data_path": _saved(train, f"{tmp}/train.jsonl"), "val_data_path": _saved(val, f"{tmp}/val.jsonl"),
                               "game_kwargs": base["env"]["config"].get("game_kwargs", {"few_shot": 1, "max_tool_calls": 3})}},
            "seed": args.seed,
        }
        spec = parse_spec(data)
        print(f"{len(train)} training and {len(val)} held-out products ({args.phrasing}); {args.steps} steps of "
              f"{args.prompts} x {args.group}, model {args.model}", flush=True)
        t0 = time.perf_counter()
        job = RLJob(spec, job_id="bench-learning-math-tool")
        load_s = time.perf_counter() - t0
        sampled: dict[int, dict] = {}
        rollout = job.rollout

        def counted_rollout(step: int):
            """Every step's sampled training episodes, counted like the held-out ones."""
            metrics = rollout(step)
            batch = job.sampler.batch(step)
            sampled[step + 1] = tool_summary(_as_transcripts(batch.trajectories)) | {"reward_mean": metrics["rollout/reward_mean"]}
            return metrics

        job.rollout = counted_rollout

        def on_step(r):
            m = r.metrics
            print(f"step {r.step:>3}: sampled reward {m['rollout/reward_mean']:.3f} tool calls {m.get('rollout/tool_call_rate', 0):.2f} "
                  f"tool success {_pct(sampled[r.step]['tool_success_rate'])} format {m.get('rollout/format_ok', 0):.2f} "
                  f"({m['step/seconds']:.1f}s)", flush=True)

        def on_eval(e):
            s = tool_summary(e.transcripts)
            print(f"eval {e.step:>3}: accuracy {s['accuracy']:.3f} tool calls {s['tool_call_rate']:.3f} "
                  f"tool success {_pct(s['tool_success_rate'])} format {s['format_rate']:.3f} "
                  f"({e.metrics['eval/seconds']:.1f}s)", flush=True)

        result = job.run(on_step=on_step, on_eval=on_eval)

    curve = []
    for ev in result.evaluations:
        s = tool_summary(ev.transcripts)
        curve.append({
            "step": ev.step,
            **s,
            "metrics_tool_call_rate": ev.metrics.get("eval/tool_call_rate"),  # the same numbers via opentinker.metrics
            "metrics_tool_error_rate": ev.metrics.get("eval/tool_error_rate"),
            "sampled_train": {k: v for k, v in sampled.get(ev.step, {}).items() if k == "reward_mean"} or None,
            "examples": [_example(t) for t in ev.transcripts[:3]],
        })
    first, last = curve[0], curve[-1]
    train_curve = [{"step": s, **{k: v for k, v in m.items()}} for s, m in sorted(sampled.items())]
    third = max(1, len(train_curve) // 3)
    early, late = train_curve[:third], train_curve[-third:]
    verdict = (f"{_trend('tool-call success rate', first['tool_success_rate'], last['tool_success_rate'])}; "
               f"{_trend('accuracy', first['accuracy'], last['accuracy'])}; "
               f"{_trend('tool-call rate', first['tool_call_rate'], last['tool_call_rate'])} "
               f"(step {first['step']} -> step {last['step']}, {len(val)} held-out products, greedy). "
               f"Sampled training rollouts, steps {early[0]['step']}-{early[-1]['step']} -> {late[0]['step']}-{late[-1]['step']}: "
               f"{_trend('tool-call success rate', _pooled(early), _pooled(late))}; "
               f"{_trend('reward', _mean(early, 'reward_mean'), _mean(late, 'reward_mean'))}")
    step_times = [h["step/seconds"] for h in result.history]
    spec_json = spec.model_dump(mode="json")
    spec_json["env"]["config"] |= {"data_path": f"<{len(train)} products of two numbers in 10..99>",
                                   "val_data_path": f"<{len(val)} held-out products>"}
    out = {
        "spec": spec_json,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__},
        "model_load_seconds": load_s,
        "wall_seconds": result.seconds,
        "median_step_seconds": sorted(step_times)[len(step_times) // 2] if step_times else None,
        "curve": curve,
        "sampled_train_curve": train_curve,
        "verdict": verdict,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out + ".json").write_text(json.dumps(out, indent=2))
    r = spec_json["rollout"]
    lines = [
        f"# Learning curve: {args.model}, 2-digit products with a calculator tool, LoRA r16 + GRPO (CPU)",
        "",
        (f"{args.steps} steps of {args.prompts} prompts x {args.group} samples, up to {r['max_turns']} turns of {r['max_new_tokens']} "
         f"new tokens (a calculator call in <tool_call> -> its <tool_response>, then 'Answer: N'); reward 1 for a correct answer only. "
         f"Questions phrased {args.phrasing!r} (e.g. {val[0]['question']!r}). Greedy evaluation on {len(val)} held-out products."),
        f"Wall time {result.seconds:.0f} s (median step {out['median_step_seconds'] or 0:.1f} s, evaluations included in the wall time).",
        "",
        "Greedy, held-out:",
        "",
        _TABLE_HEAD,
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    lines += [_row(c["step"], c) for c in curve]
    lines += ["", f"Sampled training rollouts ({args.prompts} x {args.group} episodes a step, temperature {r['temperature']:g}):",
              "", _TABLE_HEAD.replace("answer copies last result", "reward"), "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    lines += [_row(c["step"], c, reward=True) for c in train_curve]
    lines += ["", f"Verdict: {verdict}", "", "Held-out examples at the first and the last evaluation:", ""]
    for ex in first["examples"]:
        lines += ["```", *ex, "```"]
    for ex in last["examples"]:
        lines += ["```", *ex, "```"]
    lines.append("")
    Path(args.out + ".md").write_text("\n".join(lines))
    print("\n".join(lines), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
