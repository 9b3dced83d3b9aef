"""Learning curve of SmolLM2-135M-Instruct at Gomoku (LoRA r16 + GRPO), on this CPU.

(a) Single agent (envs.gomoku:GomokuGame): the model plays X, moving first, against the scripted
`random` opponent on a 6x6 board with 4 in a row, so that games are short. The system prompt
gives the rules and the move format 'Move: row,col'; each user turn shows the board. An
unreadable, off-board or occupied move is answered with the reason and must be retried; the
third one in a game loses it. Reward at the end: +1 win, -1 loss (forfeit included), 0 draw or
unfinished (the episode stops after `--max-turns` model turns). Held-out games (opponent seeds
never used in training) are played greedily before training and every `--every` steps: win /
loss / unfinished rates vs random, illegal-move rate (illegal attempts / all attempts), forfeit
rate, and game length (stones on the board at the end). `--eval-mode sampled` plays them at the
training temperature instead: the greedy policy of a 135M model plays one fixed line whatever the
board (the example's row, continued off the board), and GRPO moves the sampled distribution
long before it moves that argmax.

By default the game shows one example exchange before the game (`few_shot: 1`: two moves along
a row, with the environment's own replies, see envs/gomoku/examples.py), as the math games do.
Without it (`--no-example`) SmolLM2-135M-Instruct almost never writes a
readable move: it talks about the game instead, every game is lost by forfeit within 3 turns, all
rewards are -1 and GRPO's group advantages are all zero, so nothing can be learned.

(b) Self-play (skip with --no-selfplay; envs.gomoku:GomokuSelfPlay via SelfPlayJob with
`opponent: snapshot`): X learns against a frozen copy of itself (O) from openings of 2 random
stones. Both start from the policy trained in (a) (`--sp-from-scratch`: from the base model),
and the snapshot is refreshed every `--sp-snapshot-every` steps (by default never within the run,
so the last evaluation is the learner against the policy it started from). Held-out openings
are played greedily before and after training: the learner's illegal-move rate (illegal / its
turns) and its win / loss / draw rates against the snapshot. Each player is shown its own
example exchange (GomokuSelfPlay `few_shot: 1`: its first two moves of an earlier match, as the
match showed them; `--no-example` drops it too). A sampled X that does make a legal
move usually wins, because the snapshot O then forfeits.

Cost: an episode carries the whole conversation (rules ~160 tokens, example ~230, a board ~90
tokens per turn). Measured before the prefix cache (which now runs only the new tokens of a
turn: 3-4x faster rollouts, bench/multiturn_rollout.py), an episode cost ~15 s of this 2-core
CPU (rollout + update) and a greedy held-out game ~7 s; the defaults (6 steps of 2 x 4 games, 8 held-out games, 1 self-play step)
are sized for ~15 minutes (--no-selfplay saves ~3). Scale with --steps / --prompts / --eval-n
when more time is available. Training memory grows with the square of the sequence length
(peak RSS ~10 GB at --micro-batch 2), hence micro-batches of one sequence.

    python bench/learning_gomoku.py [--steps 6] [--every 3] [--eval-n 8] [--prompts 2] [--no-selfplay]
    python bench/learning_gomoku.py ... --vs-greedy   # also the held-out games vs the greedy opponent, before and after
    python bench/learning_gomoku.py --model tiny-random --steps 1 --every 1 --eval-n 4 --sp-steps 1 --out /tmp/smoke
writes bench/results/learning_gomoku.json and bench/results/learning_gomoku.md (or --out)
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import resource
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from envs.gomoku.examples import game_example

def _spec_data(args, tmp: str, steps: int, every: int, prompts: int, eval_n: int, env: dict, **extra) -> dict:
    return {
        "model": {"name": args.model},
        "adapter": {"kind": "lora", "r": 16, "alpha": 32},
        "algorithm": {"advantage": "grpo", "clip_range": 0.2},
        "rollout": {"prompts_per_step": prompts, "group_size": args.group, "max_new_tokens": args.max_new_tokens,
                    "temperature": 1.0, "max_turns": args.max_turns, "max_total_tokens": args.max_total_tokens},
        "optimization": {"lr": args.lr, "steps": steps, "micro_batch_size": args.micro_batch},
        "evaluation": {"every": every, "greedy": args.eval_mode == "greedy", "n_samples": eval_n},
        "checkpoint": {"every": 0, "base_url": f"file://{tmp}"},
        "env": env,
        "seed": args.seed,
        **extra,
    }


def game_summary(transcripts: list[dict], max_illegal: int) -> dict:
    """Outcomes of the evaluation games, from each episode's final info."""
    n = len(transcripts) or 1
    infos = [t["info"] for t in transcripts]
    results = [i.get("result") for i in infos]
    illegal = sum(int(i.get("illegal_moves", 0)) for i in infos)
    moves = sum(int(i.get("moves", 0)) for i in infos)
    return {
        "win_rate": results.count("win") / n,
        "loss_rate": results.count("loss") / n,
        "draw_rate": results.count("draw") / n,
        "unfinished_rate": results.count(None) / n,
        "forfeit_rate": sum(i.get("result") == "loss" and int(i.get("illegal_moves", 0)) > max_illegal for i in infos) / n,
        "illegal_move_rate": illegal / (illegal + moves) if illegal + moves else 0.0,
        "legal_moves_per_game": moves / n,
        "game_length": sum(float(i.get("game_length", 0)) for i in infos) / n,
        "games": len(transcripts),
        "wins": results.count("win"),
        "illegal_moves": illegal,
        "legal_moves": moves,
    }


def significance(first: dict, last: dict) -> str:
    """One-sided Fisher exact tests between two evaluations: did the win rate rise (games are
    independent draws) and the illegal-move rate fall (moves of one game are not independent, so
    that p-value is optimistic)?"""
    from scipy.stats import fisher_exact

    wins = [[last["wins"], last["games"] - last["wins"]], [first["wins"], first["games"] - first["wins"]]]
    illegal = [[first["illegal_moves"], first["legal_moves"]], [last["illegal_moves"], last["legal_moves"]]]
    return (f"wins {first['wins']}/{first['games']} -> {last['wins']}/{last['games']}, one-sided Fisher exact "
            f"p = {fisher_exact(wins, alternative='greater').pvalue:.3g}; illegal moves "
            f"{first['illegal_moves']}/{first['illegal_moves'] + first['legal_moves']} -> "
            f"{last['illegal_moves']}/{last['illegal_moves'] + last['legal_moves']} attempts, "
            f"p = {fisher_exact(illegal, alternative='greater').pvalue:.3g} (moves within a game are correlated: optimistic)")


def _game_text(t: dict, example_len: int, turns: int = 4) -> list[str]:
    """A held-out game after the system prompt and the example: the model's first moves and the
    first line of each reply (boards left out), then the result."""
    msgs = [m for m in t["messages"] if m["role"] != "system"][example_len:]
    out = []
    for m in msgs[1: 1 + 2 * turns]:
        text = m["content"].strip() or repr(m["content"])
        out.append(f"{m['role']}: {text.split(chr(10) + chr(10))[0] if m['role'] == 'user' else text}")
    i = t["info"]
    out.append(f"... {i.get('result') or 'unfinished'} after {i.get('moves', 0)} legal and {i.get('illegal_moves', 0)} "
               f"illegal moves, {i.get('game_length', 0)} stones on the board")
    return out


def _trend(name: str, first: float | None, last: float | None, note: str) -> str:
    if first is None or last is None:
        return f"{name} n/a"
    diff = last - first
    word = "rose" if diff > 0 else ("fell" if diff < 0 else "unchanged")
    return f"{name} {first:.1%} -> {last:.1%} ({word}, {diff * 100:+.1f} pts; {note})"


def single_agent(args) -> tuple[dict, dict]:
    """Part (a); returns (results, the learner's final trainable state)."""
    from opentinker.rl import RLJob
    from opentinker.core.spec import parse_spec

    game_kwargs = {"size": args.size, "win_length": args.win_length, "opponent": "random", "max_illegal": args.max_illegal,
                   "few_shot": 0 if args.no_example else 1}
    env = {"game": "envs.gomoku:GomokuGame", "config": {"model_plays": "X", "val_size": args.eval_n, "game_kwargs": game_kwargs}}
    example_len = 0 if args.no_example else len(game_example(args.size, args.win_length, args.max_illegal))
    with tempfile.TemporaryDirectory() as tmp:
        spec = parse_spec(_spec_data(args, tmp, args.steps, args.every, args.prompts, args.eval_n, env))
        print(f"[single] {args.size}x{args.size}, {args.win_length} in a row, X vs random, "
              f"{'no example' if args.no_example else 'one example exchange'}; {args.steps} steps of "
              f"{args.prompts} x {args.group}; model {args.model}", flush=True)
        t0 = time.perf_counter()
        job = RLJob(spec, job_id="bench-learning-gomoku")
        load_s = time.perf_counter() - t0
        sampled: dict[int, dict] = {}

        def on_step(r):
            m = r.metrics
            sampled[r.step] = {"reward_mean": m["rollout/reward_mean"], "win_rate": m.get("rollout/accuracy"),
                               "illegal_move_rate": m.get("rollout/illegal_move_rate")}
            print(f"[single] step {r.step:>3}: sampled reward {m['rollout/reward_mean']:+.3f} win {m.get('rollout/accuracy', 0):.2f} "
                  f"illegal {m.get('rollout/illegal_move_rate', 0):.2f} turns {m['rollout/turns_mean']:.1f} "
                  f"(rollout {m['rollout/seconds']:.0f}s, update {m.get('update/seconds', 0):.0f}s, total {m['step/seconds']:.0f}s)",
                  flush=True)

        def on_eval(e):
            s = game_summary(e.transcripts, args.max_illegal)
            print(f"[single] eval {e.step:>3}: win {s['win_rate']:.3f} loss {s['loss_rate']:.3f} unfinished {s['unfinished_rate']:.3f} "
                  f"illegal {s['illegal_move_rate']:.3f} forfeits {s['forfeit_rate']:.3f} length {s['game_length']:.1f} "
                  f"({e.metrics['eval/seconds']:.0f}s)", flush=True)

        greedy_check = _GreedyCheck(spec, job, args) if args.vs_greedy else None
        result = job.run(on_step=on_step, on_eval=on_eval)
        state = job.policy.trainer.trainable_state()
        vs_greedy = greedy_check.finish() if greedy_check else None
    curve = [{"step": ev.step, **game_summary(ev.transcripts, args.max_illegal),
              "metrics_illegal_move_rate": ev.metrics.get("eval/illegal_move_rate"),  # the same, via opentinker.metrics
              "sampled_train": sampled.get(ev.step),
              "examples": [_game_text(t, example_len) for t in ev.transcripts[:2]]} for ev in result.evaluations]
    step_times = [h["step/seconds"] for h in result.history]
    spec_json = spec.model_dump(mode="json")
    if not args.no_example:
        spec_json["env"]["example_turns"] = game_example(args.size, args.win_length, args.max_illegal)
    del job
    gc.collect()
    return {"spec": spec_json, "model_load_seconds": load_s, "wall_seconds": result.seconds,
            "median_step_seconds": sorted(step_times)[len(step_times) // 2] if step_times else None, "curve": curve,
            "vs_greedy": vs_greedy}, state


class _GreedyCheck:
    """The same held-out games against the greedy opponent, played by the base policy now and by
    the trained one at `finish()`, each after reseeding (identical conditions)."""

    def __init__(self, spec, job, args):
        from opentinker.rl import Sampler

        env = spec.env.model_dump(mode="json")
        env["config"]["game_kwargs"]["opponent"] = "greedy"
        self.spec = spec.model_copy(update={"env": type(spec.env).model_validate(env)})
        self.worker = Sampler(self.spec, job.policy.model, job.policy.tokenizer)
        self.max_illegal = args.max_illegal
        self.before = self._play("before training")

    def _play(self, when: str) -> dict:
        from opentinker.core.seeding import seed_everything

        seed_everything(self.spec.seed)
        t0 = time.perf_counter()
        s = game_summary(self.worker.evaluate(0).transcripts, self.max_illegal)
        print(f"[single] vs greedy, {when}: win {s['win_rate']:.3f} loss {s['loss_rate']:.3f} illegal "
              f"{s['illegal_move_rate']:.3f} forfeits {s['forfeit_rate']:.3f} ({time.perf_counter() - t0:.0f}s)", flush=True)
        return s

    def finish(self) -> dict:
        after = self._play("after training")
        return {"before": self.before, "after": after, "significance": significance(self.before, after)}


def self_play(args, init_state: dict | None) -> dict:
    from opentinker.rl.selfplay import SelfPlayJob
    from opentinker.core.spec import parse_spec

    env = {"game": "envs.gomoku:GomokuSelfPlay",
           "config": {"size": args.size, "opening_stones": 2, "val_size": args.sp_eval_n,
                      "game_kwargs": {"size": args.size, "win_length": args.win_length, "max_illegal": args.max_illegal,
                                      "few_shot": 0 if args.no_example else 1}}}
    snapshot_every = args.sp_snapshot_every or args.sp_steps + 1
    with tempfile.TemporaryDirectory() as tmp:
        data = _spec_data(args, tmp, args.sp_steps, args.sp_every, args.sp_prompts, args.sp_eval_n, env,
                          multiagent={"players": ["X", "O"], "opponent": "snapshot", "snapshot_every": snapshot_every})
        spec = parse_spec(data)
        start = "the base model" if init_state is None else "the policy trained in (a)"
        print(f"[selfplay] X learns vs a snapshot of itself (refreshed every {snapshot_every} steps), both from {start}; "
              f"{args.sp_steps} steps of {args.sp_prompts} openings x {args.group}", flush=True)
        t_start = time.perf_counter()
        job = SelfPlayJob(spec, job_id="bench-learning-gomoku-selfplay")
        if init_state is not None:
            job.policies["X"].trainer.load_trainable_state(init_state)
            job.refresh_snapshot()  # the snapshot starts as the same policy
        keys = ("illegal_move_rate", "win_rate", "loss_rate", "draw_rate", "game_length")
        curve, steps_s = [], []

        def evaluate(step: int) -> None:
            t0 = time.perf_counter()
            m = job.evaluate(step).metrics
            row = {"step": step, **{k: m.get(f"X/eval/{k}") for k in keys}, "seconds": time.perf_counter() - t0}
            curve.append(row)
            print(f"[selfplay] eval {step:>3}: learner illegal {row['illegal_move_rate']:.3f} win {row['win_rate']:.3f} "
                  f"loss {row['loss_rate']:.3f} draw {row['draw_rate']:.3f} length {row['game_length']:.1f} "
                  f"({row['seconds']:.0f}s)", flush=True)

        evaluate(0)
        for step in range(args.sp_steps):
            t0 = time.perf_counter()
            m = job.rollout(step) | job.update(step)
            steps_s.append(time.perf_counter() - t0)
            print(f"[selfplay] step {step + 1:>3}: learner reward {m['X/rollout/reward_mean']:+.3f} illegal "
                  f"{m['X/rollout/illegal_move_rate']:.2f} win {m['X/rollout/win_rate']:.2f} ({steps_s[-1]:.0f}s)", flush=True)
            if spec.evaluates_at(step + 1):
                evaluate(step + 1)
    return {"spec": spec.model_dump(mode="json"), "initialised_from": start, "wall_seconds": time.perf_counter() - t_start,
            "median_step_seconds": sorted(steps_s)[len(steps_s) // 2] if steps_s else None, "curve": curve}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6, help="single-agent training steps")
    parser.add_argument("--every", type=int, default=3)
    parser.add_argument("--eval-n", type=int, default=8, help="held-out games per single-agent evaluation")
    parser.add_argument("--prompts", type=int, default=2, help="games (opponent seeds) per step")
    parser.add_argument("--group", type=int, default=4, help="samples per game")
    parser.add_argument("--size", type=int, default=6)
    parser.add_argument("--win-length", type=int, default=4)
    parser.add_argument("--max-illegal", type=int, default=2, help="invalid moves allowed per game; one more loses it")
    parser.add_argument("--max-turns", type=int, default=5, help="model turns per game (legal and illegal moves)")
    parser.add_argument("--max-new-tokens", type=int, default=8)
    parser.add_argument("--max-total-tokens", type=int, default=1280)
    parser.add_argument("--micro-batch", type=int, default=1, help="sequences per forward/backward; memory grows with it (peak RSS ~10 GB at 2, ~15 GB at 4)")
    parser.add_argument("--lr", type=float, default=2e-4)
    parser.add_argument("--eval-mode", choices=["greedy", "sampled"], default="greedy",
                        help="held-out games played greedily, or sampled at the training temperature (the policy GRPO trains)")
    parser.add_argument("--no-example", action="store_true", help="plain envs.gomoku:GomokuGame, no example exchange")
    parser.add_argument("--no-selfplay", action="store_true", help="skip part (b)")
    parser.add_argument("--vs-greedy", action="store_true",
                        help="also play the held-out games against the scripted greedy opponent (it blocks an immediate win) "
                             "before and after training: does the policy do more than exploit the random opponent?")
    parser.add_argument("--sp-steps", type=int, default=1)
    parser.add_argument("--sp-every", type=int, default=0, help="self-play evaluations every k steps (0: before and after)")
    parser.add_argument("--sp-prompts", type=int, default=2, help="openings per self-play step")
    parser.add_argument("--sp-eval-n", type=int, default=4)
    parser.add_argument("--sp-snapshot-every", type=int, default=0, help="0: never refreshed within the run")
    parser.add_argument("--sp-from-scratch", action="store_true", help="self-play from the base model, not from (a)")
    parser.add_argument("--model", default="smollm2-135m-instruct", help="e.g. tiny-random for a smoke run")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "learning_gomoku"))
    args = parser.parse_args()

    import torch

    from opentinker.cli.common import quiet_libraries

    quiet_libraries()
    torch.set_num_threads(os.cpu_count() or 1)
    t0 = time.perf_counter()
    single, state = single_agent(args)
    selfplay = None if args.no_selfplay else self_play(args, None if args.sp_from_scratch else state)

    first, last = single["curve"][0], single["curve"][-1]
    verdict = (f"vs random, {args.eval_mode} on {first['games']} held-out games: "
               f"{_trend('illegal-move rate', first['illegal_move_rate'], last['illegal_move_rate'], 'lower is better')}; "
               f"{_trend('win rate', first['win_rate'], last['win_rate'], 'higher is better')} "
               f"(step {first['step']} -> step {last['step']}); {significance(first, last)}")
    sp_verdict = None
    if selfplay and selfplay["curve"]:
        a, b = selfplay["curve"][0], selfplay["curve"][-1]
        sp_verdict = (f"learner vs snapshot on {args.sp_eval_n} held-out openings: "
                      f"{_trend('illegal-move rate', a['illegal_move_rate'], b['illegal_move_rate'], 'lower is better')}; "
                      f"{_trend('win rate', a['win_rate'], b['win_rate'], 'step 0 is the policy against itself')} "
                      f"(step {a['step']} -> step {b['step']})")
    out = {
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__},
        "wall_seconds": time.perf_counter() - t0,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "single_agent": single,
        "selfplay": selfplay,
        "verdict": verdict,
        "selfplay_verdict": sp_verdict,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out + ".json").write_text(json.dumps(out, indent=2))
    r = single["spec"]["rollout"]
    lines = [
        f"# Learning curve: {args.model}, Gomoku {args.size}x{args.size} ({args.win_length} in a row), LoRA r16 + GRPO (CPU)",
        "",
        "## (a) X against the scripted random opponent",
        "",
        f"{args.steps} steps of {args.prompts} games x {args.group} samples; up to {r['max_turns']} model turns of "
        f"{r['max_new_tokens']} new tokens ('Move: row,col'); reward +1 win, -1 loss (more than {args.max_illegal} invalid "
        f"moves lose), 0 draw or unfinished. "
        + ("Plain GomokuGame prompt (no example). " if args.no_example else
           "GomokuGame plus one example exchange (two moves along a row, see the JSON). ")
        + f"{args.eval_mode.capitalize()} evaluation on {first['games']} held-out games"
        + (f" (temperature {r['temperature']})." if args.eval_mode == "sampled" else "."),
        f"Wall time {single['wall_seconds']:.0f} s (median step {single['median_step_seconds'] or 0:.0f} s, evaluations included). "
        f"Command: `python bench/learning_gomoku.py {' '.join(sys.argv[1:])}`.",
        "",
        "| step | win rate | loss rate | unfinished | illegal-move rate | forfeits | legal moves / game | game length | sampled train reward |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for c in single["curve"]:
        sr = "-" if not c["sampled_train"] else f"{c['sampled_train']['reward_mean']:+.3f}"
        lines.append(f"| {c['step']} | {c['win_rate']:.1%} | {c['loss_rate']:.1%} | {c['unfinished_rate']:.1%} | "
                     f"{c['illegal_move_rate']:.1%} | {c['forfeit_rate']:.1%} | {c['legal_moves_per_game']:.1f} | "
                     f"{c['game_length']:.1f} | {sr} |")
    lines += ["", f"Verdict: {verdict}", ""]
    if g := single["vs_greedy"]:
        lines += ["The same held-out games against the scripted greedy opponent (it wins when it can, blocks the model's "
                  "immediate win, else extends its own longest line), base policy before training and trained policy after, each after reseeding:", "",
                  "| policy | win rate | loss rate | unfinished | illegal-move rate | forfeits | legal moves / game |",
                  "|---|---:|---:|---:|---:|---:|---:|"]
        for when in ("before", "after"):
            c = g[when]
            lines.append(f"| {when} training | {c['win_rate']:.1%} | {c['loss_rate']:.1%} | {c['unfinished_rate']:.1%} | "
                         f"{c['illegal_move_rate']:.1%} | {c['forfeit_rate']:.1%} | {c['legal_moves_per_game']:.1f} |")
        lines += ["", f"vs greedy: {g['significance']}", ""]
    lines += ["Held-out games at the last evaluation (first turns):", ""]
    for ex in last["examples"]:
        lines += ["```", *ex, "```"]
    if selfplay:
        lines += [
            "", "## (b) Self-play against a snapshot", "",
            (f"{args.sp_steps} steps of {args.sp_prompts} openings (2 random stones) x {args.group}; X learns, O is a frozen "
             f"copy of X (both from {selfplay['initialised_from']}), refreshed every {selfplay['spec']['multiagent']['snapshot_every']} "
             f"steps. {args.eval_mode.capitalize()} evaluation on {args.sp_eval_n} held-out openings."),
            f"Wall time {selfplay['wall_seconds']:.0f} s (median step {selfplay['median_step_seconds'] or 0:.0f} s).",
            "",
            "| step | learner illegal-move rate | win rate | loss rate | draw rate | game length |",
            "|---:|---:|---:|---:|---:|---:|",
        ]
        for c in selfplay["curve"]:
            lines.append(f"| {c['step']} | {c['illegal_move_rate']:.1%} | {c['win_rate']:.1%} | {c['loss_rate']:.1%} | "
                         f"{c['draw_rate']:.1%} | {c['game_length']:.1f} |")
        lines += ["", f"Verdict: {sp_verdict}"]
    lines.append("")
    Path(args.out + ".md").write_text("\n".join(lines))
    print("\n".join(lines), flush=True)
    print(f"total {out['wall_seconds']:.0f} s, peak RSS {out['peak_rss_mb']:.0f} MB", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
