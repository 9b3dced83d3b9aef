"""Learning curves on environments people already have: reasoning-gym and TextArena (LoRA r16 + GRPO, CPU).

Three parts, each measured in this one run (`--parts` picks some):

(timing) What an adapter adds per environment step, no model: wall ms of the env calls of an
episode (make_game, reset through opentinker.env.hosting.start_episode, every step) per step,
the adapter and a native shipped game measured side by side, in alternating rounds, after a
warm-up round (imports, dataset builds), median over `--timing-rounds`:
  - reasoning-gym chain_sum (envs.reasoning_gym:ReasoningGymGame) against envs.math:MathGame,
    each answered correctly by script ('<answer>N</answer>' / 'Answer: N'): one step an episode;
  - TextArena TicTacToe-v0 (envs.textarena:TextArenaMatch, the self-play match) against Gomoku on
    a 3x3 board with 3 in a row (envs.gomoku:GomokuSelfPlay, the same game), both playing the very
    same seeded move sequences to the end ('[4]' / 'Move: 1,1'), each move after the mover's
    observation, as the self-play loop asks for them;
  - the same two games against their scripted random opponents (TextArenaGame with model_plays 0,
    GomokuGame as X), the scripted side always taking the first free cell: the opponents' moves,
    which differ, are part of the cost (TextArena's tries candidate moves on a copy of the game).

(reasoning_gym) For each of `--datasets` (default chain_sum and leg_counting, configs in PRESETS):
an RLJob on `env: {source: reasoning_gym, dataset, config}`, 8 questions x 4 samples a step, 32 new
tokens, T=0.7 (as examples/math_grpo.yaml), reward the dataset's own score_answer (0..1, partial
credit when the number is inside a longer answer). Greedy held-out success = the share of the
`--eval-n` held-out items scored 1, at step 0 (the base model) and every `--every` steps; also the
format rate (an <answer> tag) and the share of distinct answers (a collapse onto one number shows).
The configs are the datasets' easiest corners where a 135M instruct model should be neither at 0
nor at 100: chain_sum of two terms of 1-2 digits ('47 - 83 =', negative results included);
leg_counting with 1-2 kinds of animals, 1-3 of each ('2 spiders, 1 cow': knowing the legs, then
a product and a sum). Their question spaces are small enough that a held-out item can repeat a
question drawn for training (held-out means another index of the pool): the run counts how many
distinct held-out questions its training draws contain (`heldout_overlap`) and says so.
System prompt: reasoning-gym's default asks the model to think step by step, then answer in
<answer> tags; a 135M model's "thinking" is expected to fill the token budget before it closes
the tag, and a batch that scores 0 everywhere gives GRPO no signal. So the game's own override
(`game_kwargs.system_prompt`) is set to PROMPT, one sentence that shows the tag around a number
(as the math bench shows 'Answer: 7' in an example turn); what is learned is then the arithmetic,
not the tag. The prompt alone is not enough for SmolLM2-135M (checked by hand: it answers "The
answer is 47." and never writes the tag, so every reward is 0), so the game also shows `--few-shot`
(default 1) answered exchanges first (`game_kwargs.few_shot`), after which it writes the tag in some
replies. `--system-prompt default` (or any reasoning-gym prompt name) runs reasoning-gym's own.

(textarena) `--game` (default TicTacToe-v0) trained by self-play: a SelfPlayJob on
envs.textarena:TextArenaMatch with `multiagent: {players: [P0, P1], opponent: self}` (one policy
plays both seats and learns from both records; `--sp-opponent snapshot`: against a frozen copy of
itself), `--ta-prompts` seeds x 4 matches a step, 16 new tokens a move, T=1, reward the match
result (+1 / -1 / 0; a move the game refuses costs the turn as TextArena rules it, a second one
the game). It never meets the fixed opponent in training; evaluated against it: greedy games
against TextArena's scripted random opponent (TextArenaMatch.evaluation_env: TextArenaGame with
model_plays), `--eval-n` held-out games, half in each seat, through the learner's own model, at
step 0 and every `--every` steps. Success = win rate; also loss / draw / unfinished rates and the
illegal-move rate. For scale: a random player wins about 58% of its games against random as the
first mover, 29% as the second. The base model is expected to lose most games by refused moves
(e.g. repeating the rules' example '[4]' on a taken cell), so legal play is most of what there is
to learn first.

Targets ("a stated improvement over the base model", greedy held-out success at the last
evaluation minus step 0): +10 points on each reasoning-gym dataset, +15 points of win rate on
the TextArena game (TARGET_GAIN); the one-sided Fisher exact p-value of the difference is
printed beside it.

Cost on this 2-core CPU (measured): timing ~1 min; a reasoning-gym dataset's 25 steps with 6
evaluations of 64 items 9-12 min; TicTacToe's steps grow with the games: 80 s at step 1 (1.1 moves
a seat), 340-430 s by steps 6-8 (4 moves a seat: the update over 32 records of up to 1,280 tokens
dominates), an evaluation of 32 games 54-201 s, so its 25 steps take about 2.5-3 hours, peak RSS
12.6 GB by step 6 (a 25-step run was stopped at step 8 for time). `--ta-prompts 2` halves a
step's matches (steps 65 s at first, ~200 s later; 24 steps and 6 evaluations in 98 min, peak
12.7 GB); `--ta-deadline-min M` ends the self-play run, evaluated last, before a step that would
end past M minutes, and records where it stopped.

    python bench/learning_collections.py [--steps 30] [--every 5] [--eval-n 64] [--seed 0]
    python bench/learning_collections.py --parts timing                      # the adapter cost only (~1 min)
    python bench/learning_collections.py --parts reasoning_gym --datasets chain_sum,basic_arithmetic
    python bench/learning_collections.py --model tiny-random --steps 2 --every 1 --eval-n 4 --out /tmp/lc_smoke
    python bench/learning_collections.py --rerender --out bench/results/learning_collections_leg_counting   # its table again, no run
writes bench/results/learning_collections.json and .md (or --out)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import resource
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PROMPT = "Answer with the final number only, between answer tags, for example <answer>17</answer>."
PRESETS = {  # reasoning-gym configs (its own names); the first two are the defaults
    "chain_sum": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2},
    "leg_counting": {"min_animals": 1, "max_animals": 2, "min_instances": 1, "max_instances": 3},
    "basic_arithmetic": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2, "operators": ["+", "-", "*"],
                         "allow_parentheses": False, "allow_negation": False},
}
TARGET_GAIN = {"reasoning_gym": 0.10, "textarena": 0.15}
COLLAPSE_SHARE = 0.10  # fewer distinct answers than this share of the held-out items, and fewer than the base's: no target met
RG_ROLLOUT = {"max_new_tokens": 32, "temperature": 0.7, "max_turns": 1, "max_total_tokens": 512}
TA_ROLLOUT = {"max_new_tokens": 16, "temperature": 1.0, "max_turns": 8, "max_total_tokens": 1280}
PARTS = ("timing", "reasoning_gym", "textarena")


def spec_data(args, tmp: str, env: dict, *, prompts: int, rollout: dict, lr: float, micro_batch: int, eval_n: int, **extra) -> dict:
    return {
        "model": {"name": args.model},
        "adapter": {"kind": "lora", "r": 16, "alpha": 32},
        "algorithm": {"advantage": "grpo", "clip_range": 0.2},
        "rollout": {"prompts_per_step": prompts, "group_size": args.group, **rollout},
        "optimization": {"lr": lr, "steps": args.steps, "micro_batch_size": micro_batch},
        "evaluation": {"every": args.every, "greedy": True, "n_samples": eval_n},
        "checkpoint": {"every": 0, "base_url": f"file://{tmp}"},
        "env": env,
        "seed": args.seed,
        **extra,
    }


def fisher_gain(first: tuple[int, int], last: tuple[int, int]) -> float:
    """One-sided Fisher exact p-value that `last` (successes, trials) beats `first`."""
    from scipy.stats import fisher_exact

    table = [[last[0], last[1] - last[0]], [first[0], first[1] - first[0]]]
    return float(fisher_exact(table, alternative="greater").pvalue)


# ----------------------------------------------------------------------------- (timing)


def _timed_episodes(env, tasks: list[dict], play) -> tuple[float, int]:
    """Seconds and steps of `play(game)` (it returns the steps it took) over fresh games of `tasks`."""
    from opentinker.env.hosting import start_episode

    steps, t0 = 0, time.perf_counter()
    for task in tasks:
        game = env.make_game()
        start_episode(game, task)
        steps += play(game)
    return time.perf_counter() - t0, steps


def _answer(text):
    def play(game) -> int:
        result = game.step(text(game))
        assert result.done and result.info["correct"], result.info
        return 1
    return play


def _replay(moves: list[int], text):
    """A match played move by move (each after the mover's observation) to its scripted end."""
    def play(match) -> int:
        for cell in moves:
            player = match.current_player
            match.observation_for(player)
            legal, message = match.apply(player, text(cell))
            assert legal, message
        assert match.finished
        return len(moves)
    return play


def _first_free(cells, text):
    """Against the game's scripted opponent: always the first free cell, until the game ends."""
    def play(game) -> int:
        steps = 0
        while True:
            result = game.step(text(cells(game)))
            steps += 1
            assert result.info["illegal_moves"] == 0, result.observation
            if result.done:
                return steps
    return play


def tictactoe_games(n: int, seed: int) -> list[list[int]]:
    """n seeded random tic-tac-toe games as cell sequences (0..8), each to its win or full board."""
    from envs.gomoku import GomokuMatch

    rng, games = random.Random(seed), []
    for _ in range(n):
        board, moves = GomokuMatch(3, 3), []
        for cell in rng.sample(range(9), 9):
            board.play(board.turn, *divmod(cell, 3))
            moves.append(cell)
            if board.finished:
                break
        games.append(moves)
    return games


def timing(args) -> dict:
    from envs.gomoku import GomokuGame, GomokuSelfPlay
    from envs.math import MathGame
    from envs.reasoning_gym import ReasoningGymGame
    from envs.textarena import TextArenaGame, TextArenaMatch
    from opentinker.env.environment import GameEnvironment

    n = args.timing_n
    games = tictactoe_games(n, args.seed)
    math_env = GameEnvironment(MathGame, {"low": 1, "high": 20, "val_size": n, "seed": args.seed})
    rg_env = GameEnvironment(ReasoningGymGame, {"rg_dataset": "chain_sum", **PRESETS["chain_sum"], "val_size": n, "seed": args.seed,
                                                "game_kwargs": {"system_prompt": PROMPT}})
    gomoku_match = GameEnvironment(GomokuSelfPlay, {"size": 3, "opening_stones": 0, "val_size": 1, "game_kwargs": {"size": 3, "win_length": 3}})
    ta_match = GameEnvironment(TextArenaMatch, {"env_id": "TicTacToe-v0", "val_size": n, "seed": args.seed})
    gomoku_game = GameEnvironment(GomokuGame, {"model_plays": "X", "val_size": n, "seed": args.seed,
                                               "game_kwargs": {"size": 3, "win_length": 3, "opponent": "random"}})
    ta_game = GameEnvironment(TextArenaGame, {"env_id": "TicTacToe-v0", "model_plays": 0, "val_size": n, "seed": args.seed})
    gomoku_cell = lambda c: f"Move: {c // 3},{c % 3}"  # noqa: E731
    ta_cell = lambda c: f"[{c}]"  # noqa: E731
    ta_free = lambda g: next(i for i in range(9) if not g.session.state.game_state["board"][i // 3][i % 3])  # noqa: E731
    gomoku_free = lambda g: 3 * g.match.board.empty_cells()[0][0] + g.match.board.empty_cells()[0][1]  # noqa: E731

    def replays(env, text):
        tasks = (env.validation_tasks() * n)[:n]  # the 3x3 Gomoku match has one task (no opening stones)
        return lambda: sum_pairs(_timed_episodes(env, [t], _replay(m, text)) for t, m in zip(tasks, games))

    rows = [
        ("single-turn question, answered correctly", "envs.math:MathGame", "reasoning-gym chain_sum",
         lambda: _timed_episodes(math_env, math_env.validation_tasks(), _answer(lambda g: f"Answer: {g.answer}")),
         lambda: _timed_episodes(rg_env, rg_env.validation_tasks(), _answer(lambda g: f"<answer>{g.entry['answer']}</answer>"))),
        ("tic-tac-toe match, the same moves", "envs.gomoku:GomokuSelfPlay 3x3", "TextArena TicTacToe-v0 (TextArenaMatch)",
         replays(gomoku_match, gomoku_cell), replays(ta_match, ta_cell)),
        ("tic-tac-toe vs the scripted random opponent", "envs.gomoku:GomokuGame 3x3", "TextArena TicTacToe-v0 (TextArenaGame)",
         lambda: _timed_episodes(gomoku_game, gomoku_game.validation_tasks(), _first_free(gomoku_free, gomoku_cell)),
         lambda: _timed_episodes(ta_game, ta_game.validation_tasks(), _first_free(ta_free, ta_cell))),
    ]
    out = []
    for what, native_name, adapter_name, native, adapter in rows:
        per_step = {"native": [], "adapter": []}
        for r in range(args.timing_rounds + 1):  # round 0 warms up (imports, dataset builds) and is dropped
            order = [("native", native), ("adapter", adapter)][:: 1 if r % 2 else -1]
            for name, run in order:
                seconds, steps = run()
                if r:
                    per_step[name].append(1000 * seconds / steps)
        a, b = statistics.median(per_step["native"]), statistics.median(per_step["adapter"])
        out.append({"what": what, "native": native_name, "adapter": adapter_name, "native_ms_per_step": a, "adapter_ms_per_step": b,
                    "added_ms_per_step": b - a, "ratio": b / a, "steps_per_round": steps, "rounds": per_step})
        print(f"[timing] {what}: {native_name} {a:.3f} ms/step, {adapter_name} {b:.3f} ms/step "
              f"(+{b - a:.3f} ms, x{b / a:.1f})", flush=True)
    return {"episodes_per_round": n, "rounds": args.timing_rounds, "rows": out}


def sum_pairs(pairs) -> tuple[float, int]:
    seconds, steps = 0.0, 0
    for s, k in pairs:
        seconds, steps = seconds + s, steps + k
    return seconds, steps


# ----------------------------------------------------------------------------- (reasoning_gym)


def heldout_overlap(spec, draws: int) -> dict:
    """How many distinct held-out questions are also among the first `draws` training questions
    (the job's own draw order: the same seeded environment)."""
    from opentinker.core.env_sources import build_dataset
    from opentinker.env import environment_from_spec

    env = environment_from_spec(spec)
    question = lambda t: build_dataset(t["dataset"], t["config"])[t["index"]]["question"]  # noqa: E731
    held = {question(t) for t in env.validation_tasks(spec.evaluation.n_samples)}
    trained = {question(t) for t in env.train_tasks(draws)}
    return {"heldout_questions": len(held), "also_trained": len(held & trained), "training_draws": draws}


def reasoning_gym_run(args, name: str) -> dict:
    from opentinker.core.spec import parse_spec
    from opentinker.rl import RLJob

    prompt = PROMPT if args.system_prompt == "short" else args.system_prompt
    env = {"source": "reasoning_gym", "dataset": name,
           "config": {**PRESETS[name], "val_size": args.eval_n, "game_kwargs": {"system_prompt": prompt, "few_shot": args.few_shot}}}
    with tempfile.TemporaryDirectory() as tmp:
        spec = parse_spec(spec_data(args, tmp, env, prompts=args.prompts, rollout=RG_ROLLOUT, lr=args.lr, micro_batch=16, eval_n=args.eval_n))
        overlap = heldout_overlap(spec, args.steps * args.prompts)
        print(f"[{name}] {PRESETS[name]}; {overlap['also_trained']} of {overlap['heldout_questions']} distinct held-out questions "
              f"are also among the {overlap['training_draws']} training draws", flush=True)
        job = RLJob(spec, job_id=f"bench-collections-{name.replace('_', '-')}")
        sampled: dict[int, float] = {}

        def on_step(r):
            m = r.metrics
            sampled[r.step] = m["rollout/reward_mean"]
            print(f"[{name}] step {r.step:>3}: sampled reward {m['rollout/reward_mean']:.3f} format {m.get('rollout/format_ok', 0):.2f} "
                  f"({m['step/seconds']:.1f}s)", flush=True)

        def on_eval(e):
            m = e.metrics
            print(f"[{name}] eval {e.step:>3}: success {m.get('eval/accuracy', 0):.3f} format {m.get('eval/format_ok', 0):.3f} "
                  f"distinct {m.get('eval/distinct_answer_share', 0):.3f} ({m['eval/seconds']:.0f}s)", flush=True)

        result = job.run(on_step=on_step, on_eval=on_eval)
        job.close()
    curve = []
    for ev in result.evaluations:
        m, ts = ev.metrics, ev.transcripts
        curve.append({"step": ev.step, "success": m.get("eval/accuracy", 0.0), "successes": sum(bool(t["info"].get("correct")) for t in ts),
                      "n": len(ts), "reward": m.get("eval/reward_mean"), "format_rate": m.get("eval/format_ok"),
                      "distinct_answer_share": m.get("eval/distinct_answer_share"), "sampled_train_reward": sampled.get(ev.step),
                      "examples": [[t["messages"][-2]["content"], t["messages"][-1]["content"], t["info"].get("expected")] for t in ts[:3]]})
    steps_s = sorted(h["step/seconds"] for h in result.history)
    return {"env": f"reasoning_gym/{name}", "kind": "reasoning_gym", "label": f"{name} (accuracy)", "measure": "greedy held-out accuracy",
            "config": PRESETS[name], "system_prompt": prompt, "heldout_overlap": overlap, "spec": spec.model_dump(mode="json"),
            "wall_seconds": result.seconds, "median_step_seconds": steps_s[len(steps_s) // 2] if steps_s else None, "curve": curve}


# ----------------------------------------------------------------------------- (textarena)


def game_summary(transcripts: list[dict]) -> dict:
    infos = [t["info"] for t in transcripts]
    results = [i.get("result") for i in infos]
    n = len(infos) or 1
    illegal = sum(int(i.get("illegal_moves", 0)) for i in infos)
    moves = sum(int(i.get("moves", 0)) for i in infos)
    return {"win_rate": results.count("win") / n, "loss_rate": results.count("loss") / n, "draw_rate": results.count("draw") / n,
            "unfinished_rate": results.count(None) / n, "illegal_move_rate": illegal / (illegal + moves) if illegal + moves else 0.0,
            "wins": results.count("win"), "games": len(infos)}


class VsScripted:
    """The learner's greedy games against the game's scripted random opponent, `per_seat` held-out
    games in each seat (TextArenaMatch.evaluation_env), played through the learner's own model."""

    def __init__(self, args, tmp: str, policy, per_seat: int):
        from envs.textarena import TextArenaMatch
        from opentinker.core.spec import parse_spec
        from opentinker.rl import Sampler

        self.samplers = {}
        for seat in TextArenaMatch.players:
            env = TextArenaMatch.evaluation_env(seat, {"env_id": args.game, "val_size": per_seat})
            spec = parse_spec(spec_data(args, tmp, env, prompts=args.ta_prompts, rollout=TA_ROLLOUT, lr=args.ta_lr, micro_batch=args.ta_micro_batch,
                                        eval_n=per_seat))
            self.samplers[seat] = Sampler(spec, policy.model, policy.tokenizer)
        self.env_section = {seat: s.spec.env.model_dump(mode="json") for seat, s in self.samplers.items()}

    def __call__(self, step: int) -> dict:
        import torch

        from opentinker.core.seeding import seed_everything

        t0, row, everything = time.perf_counter(), {"step": step}, []
        for seat, sampler in self.samplers.items():
            seed_everything(sampler.spec.seed)
            with torch.no_grad():
                ts = sampler.evaluate(step).transcripts
            sampler.engine.end_phase()
            row[seat] = game_summary(ts)
            everything += ts
        row |= game_summary(everything)
        row["success"] = row["win_rate"]
        row["seconds"] = time.perf_counter() - t0
        row["examples"] = [[m["content"] for m in t["messages"] if m["role"] == "assistant"][:4] + [t["info"].get("result") or "unfinished"]
                           for t in everything[:2]]
        return row

    def close(self) -> None:
        for sampler in self.samplers.values():
            sampler.close()


def textarena_run(args) -> dict:
    from opentinker.core.spec import parse_spec
    from opentinker.rl.selfplay import SelfPlayJob

    per_seat = max(1, args.eval_n // 2)
    env = {"game": "envs.textarena:TextArenaMatch", "config": {"env_id": args.game, "val_size": per_seat}}
    multiagent = {"players": ["P0", "P1"], "opponent": args.sp_opponent, "snapshot_every": args.sp_snapshot_every}
    with tempfile.TemporaryDirectory() as tmp:
        spec = parse_spec(spec_data(args, tmp, env, prompts=args.ta_prompts, rollout=TA_ROLLOUT, lr=args.ta_lr, micro_batch=args.ta_micro_batch,
                                    eval_n=per_seat, multiagent=multiagent))
        print(f"[{args.game}] self-play ({args.sp_opponent}), {args.steps} steps of {args.ta_prompts} seeds x {args.group} matches; "
              f"evaluated greedily against the scripted random opponent, {per_seat} held-out games per seat", flush=True)
        t_start = time.perf_counter()
        job = SelfPlayJob(spec, job_id="bench-collections-textarena")
        learner = job.policies[job.learners[0]]
        scripted = VsScripted(args, tmp, learner, per_seat)
        curve, steps_s, sampled = [], [], {}

        def evaluate(step: int) -> None:
            row = scripted(step)
            row["sampled_train"] = sampled.get(step)
            curve.append(row)
            print(f"[{args.game}] eval {step:>3} vs random: win {row['win_rate']:.3f} (P0 {row['P0']['win_rate']:.3f}, "
                  f"P1 {row['P1']['win_rate']:.3f}) loss {row['loss_rate']:.3f} draw {row['draw_rate']:.3f} "
                  f"unfinished {row['unfinished_rate']:.3f} illegal {row['illegal_move_rate']:.3f} ({row['seconds']:.0f}s)", flush=True)

        evaluate(0)
        me = job.learners[0]
        stopped = None
        for step in range(args.steps):
            if args.ta_deadline_min and steps_s and time.perf_counter() - t_start + steps_s[-1] + curve[-1]["seconds"] > 60 * args.ta_deadline_min:
                stopped = {"after_step": step, "reason": f"--ta-deadline-min {args.ta_deadline_min:g}: the next step and an evaluation would end past it"}
                print(f"[{args.game}] stopped after step {step}: {stopped['reason']}", flush=True)
                if curve[-1]["step"] != step:
                    evaluate(step)
                break
            t0 = time.perf_counter()
            m = job.rollout(step) | job.update(step)
            steps_s.append(time.perf_counter() - t0)
            sampled[step + 1] = {k: m.get(f"{me}/rollout/{k}") for k in ("reward_mean", "illegal_move_rate", "draw_rate", "game_length")}
            print(f"[{args.game}] step {step + 1:>3}: self-play illegal {m.get(f'{me}/rollout/illegal_move_rate', 0):.2f} "
                  f"draw {m.get(f'{me}/rollout/draw_rate', 0):.2f} length {m.get(f'{me}/rollout/game_length', 0):.1f} "
                  f"({steps_s[-1]:.0f}s, peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.1f} GB)", flush=True)
            if spec.evaluates_at(step + 1):
                evaluate(step + 1)
        scripted.close()
        for engine in job.engines.values():
            engine.close()
    steps_s.sort()
    return {"env": f"textarena/{args.game}", "kind": "textarena", "label": f"{args.game} vs random (win rate)",
            "measure": "greedy win rate vs the scripted random opponent (both seats)", "spec": spec.model_dump(mode="json"),
            "evaluation_env": scripted.env_section, "wall_seconds": time.perf_counter() - t_start,
            "median_step_seconds": steps_s[len(steps_s) // 2] if steps_s else None, "stopped_early": stopped, "curve": curve}


# ----------------------------------------------------------------------------- report


def compare(run: dict) -> dict:
    first, last = run["curve"][0], run["curve"][-1]
    k0, n0 = first.get("successes", first.get("wins")), first.get("n", first.get("games"))
    k1, n1 = last.get("successes", last.get("wins")), last.get("n", last.get("games"))
    gain, target = last["success"] - first["success"], TARGET_GAIN[run["kind"]]
    collapsed = collapse(first, last)
    return {"env": run["env"], "measure": run["measure"], "base_step": first["step"], "base": first["success"], "final_step": last["step"],
            "final": last["success"], "gain": gain, "target_gain": target, "target_met": gain >= target and collapsed is None,
            "collapsed": collapsed, "p_value": fisher_gain((k0, n0), (k1, n1)), "base_counts": [k0, n0], "final_counts": [k1, n1]}


def collapse(first: dict, last: dict) -> str | None:
    """Why a reasoning-gym gain is not learning the task (None: it may be): the trained policy gives
    fewer distinct answers than the base model, under COLLAPSE_SHARE of the items, so its successes
    are a frequent answer guessed everywhere (reward hacking of the answer distribution)."""
    before, after = first.get("distinct_answer_share"), last.get("distinct_answer_share")
    if before is None or after is None or after >= min(before, COLLAPSE_SHARE):
        return None
    return f"answers collapsed: {round(after * last['n'])} distinct over {last['n']} items (base {round(before * first['n'])})"


def met(c: dict) -> str:
    return "yes" if c["target_met"] else f"no ({c['collapsed']})" if c.get("collapsed") else "no"


def markdown(args, out: dict) -> list[str]:
    lines = [f"# Learning curves on reasoning-gym and TextArena: {args.model}, LoRA r16 + GRPO (CPU)", ""]
    if t := out["timing"]:
        lines += ["## What an adapter adds per step", "",
                  f"Wall ms of the environment calls per episode step (make_game, reset, steps), no model; median of {t['rounds']} "
                  f"alternating rounds of {t['episodes_per_round']} episodes, the native game measured beside the adapter.", "",
                  "| episodes | native game | ms / step | adapter | ms / step | added ms / step | ratio |", "|---|---|---:|---|---:|---:|---:|"]
        lines += [f"| {r['what']} | {r['native']} | {r['native_ms_per_step']:.3f} | {r['adapter']} | {r['adapter_ms_per_step']:.3f} | "
                  f"{r['added_ms_per_step']:+.3f} | {r['ratio']:.1f}x |" for r in t["rows"]]
        lines.append("")
    for run in out["runs"]:
        lines += [f"## {run['env']}", ""]
        if run["kind"] == "reasoning_gym":
            o = run["heldout_overlap"]
            lines += [f"Config {json.dumps(run['config'])}; system prompt {json.dumps(run['system_prompt'])}. {args.steps} steps of "
                      f"{args.prompts} questions x {args.group} samples, {RG_ROLLOUT['max_new_tokens']} new tokens, T={RG_ROLLOUT['temperature']}; "
                      f"greedy evaluation on {run['curve'][0]['n']} held-out items ({o['also_trained']} of their {o['heldout_questions']} "
                      f"distinct questions also drawn for training). Wall time {run['wall_seconds']:.0f} s "
                      f"(median step {run['median_step_seconds'] or 0:.1f} s).", "",
                      "| step | greedy accuracy | reward | format rate | distinct answers | sampled train reward |",
                      "|---:|---:|---:|---:|---:|---:|"]
            for c in run["curve"]:
                sr = "-" if c["sampled_train_reward"] is None else f"{c['sampled_train_reward']:.3f}"
                lines.append(f"| {c['step']} | {c['success']:.1%} | {c['reward'] or 0:.3f} | {c['format_rate'] or 0:.1%} | "
                             f"{c['distinct_answer_share'] or 0:.1%} | {sr} |")
        else:
            ma = run["spec"]["multiagent"]
            lines += [f"Self-play (`opponent: {ma['opponent']}`), {args.steps} steps of {args.ta_prompts} seeds x {args.group} matches, "
                      f"{TA_ROLLOUT['max_new_tokens']} new tokens a move, T={TA_ROLLOUT['temperature']}, lr {args.ta_lr:g}; greedy "
                      f"evaluation against the scripted random opponent on {run['curve'][0]['games']} held-out games (half in each seat). "
                      f"Wall time {run['wall_seconds']:.0f} s (median step {run['median_step_seconds'] or 0:.0f} s)."
                      + (f" Stopped after step {run['stopped_early']['after_step']} of {args.steps} ({run['stopped_early']['reason']})."
                         if run.get("stopped_early") else ""), "",
                      "| step | win rate | as P0 | as P1 | loss rate | draw rate | unfinished | illegal-move rate | self-play illegal-move rate |",
                      "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
            for c in run["curve"]:
                sp = "-" if not c["sampled_train"] else f"{c['sampled_train']['illegal_move_rate'] or 0:.1%}"
                lines.append(f"| {c['step']} | {c['win_rate']:.1%} | {c['P0']['win_rate']:.1%} | {c['P1']['win_rate']:.1%} | "
                             f"{c['loss_rate']:.1%} | {c['draw_rate']:.1%} | {c['unfinished_rate']:.1%} | {c['illegal_move_rate']:.1%} | {sp} |")
        lines.append("")
    if out["comparison"]:
        lines += ["## Base model against the trained policy", "",
                  "| environment | measure | base (step 0) | final | change | target | met | one-sided Fisher p |",
                  "|---|---|---:|---:|---:|---:|---|---:|"]
        lines += [f"| {c['env']} | {c['measure']} | {c['base']:.1%} | {c['final']:.1%} (step {c['final_step']}) | {c['gain'] * 100:+.1f} pts | "
                  f"+{c['target_gain'] * 100:.0f} pts | {met(c)} | {c['p_value']:.3g} |" for c in out["comparison"]]
        lines.append("")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct", help="e.g. tiny-random for a smoke run")
    parser.add_argument("--steps", type=int, default=30, help="training steps of each environment")
    parser.add_argument("--every", type=int, default=5, help="evaluate every k steps (and at step 0 and the last)")
    parser.add_argument("--eval-n", type=int, default=64, help="held-out items per reasoning-gym evaluation; held-out games per "
                        "TextArena evaluation (half in each seat)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {', '.join(PARTS)}")
    parser.add_argument("--datasets", default="chain_sum,leg_counting", help=f"reasoning-gym presets, of {', '.join(PRESETS)}")
    parser.add_argument("--system-prompt", default="short", help="'short' (PROMPT) or a reasoning-gym prompt name (default, direct, ...)")
    parser.add_argument("--few-shot", type=int, default=1, help="answered example exchanges shown before each question (game_kwargs.few_shot)")
    parser.add_argument("--prompts", type=int, default=8, help="reasoning-gym questions per step")
    parser.add_argument("--group", type=int, default=4, help="samples per question / matches per seed")
    parser.add_argument("--lr", type=float, default=2e-4, help="reasoning-gym learning rate")
    parser.add_argument("--game", default="TicTacToe-v0", help="a two-player TextArena id of envs/textarena/registry.py VERIFIED")
    parser.add_argument("--ta-prompts", type=int, default=4, help="TextArena seeds per step (x --group matches)")
    parser.add_argument("--ta-lr", type=float, default=5e-4)
    parser.add_argument("--ta-micro-batch", type=int, default=1, help="records per update pass (a match record is up to 1,280 tokens: 2 a pass took ~10 GB, and the run was killed at 23 GB)")
    parser.add_argument("--ta-deadline-min", type=float, default=None, help="stop the self-play run (evaluating last) before a step that would end past this many minutes; recorded as stopped_early")
    parser.add_argument("--sp-opponent", choices=["self", "snapshot"], default="self")
    parser.add_argument("--sp-snapshot-every", type=int, default=5, help="--sp-opponent snapshot: refresh every k steps")
    parser.add_argument("--timing-n", type=int, default=100, help="episodes per timing round")
    parser.add_argument("--timing-rounds", type=int, default=5)
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "learning_collections"))
    parser.add_argument("--rerender", action="store_true", help="rebuild --out's comparison and .md from its recorded .json (no run)")
    args = parser.parse_args()
    if args.rerender:
        out = json.loads(Path(args.out + ".json").read_text())
        recorded = parser.parse_args(shlex.split(out["command"])[2:])  # the run's own arguments, for its text
        out["comparison"] = [compare(run) for run in out["runs"]]
        Path(args.out + ".json").write_text(json.dumps(out, indent=2))
        Path(args.out + ".md").write_text("\n".join(markdown(recorded, out)))
        return 0
    parts = [p for p in args.parts.split(",") if p]
    if unknown := sorted(set(parts) - set(PARTS)) + sorted(set(args.datasets.split(",")) - set(PRESETS)):
        parser.error(f"unknown part or dataset: {', '.join(unknown)}")

    import torch

    from opentinker.cli.common import quiet_libraries

    quiet_libraries()
    torch.set_num_threads(os.cpu_count() or 1)
    t0 = time.perf_counter()
    out = {"command": shlex.join(["python", "bench/learning_collections.py", *sys.argv[1:]]),
           "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__},
           "prompt": PROMPT, "targets": TARGET_GAIN, "timing": None, "runs": []}
    if "timing" in parts:
        out["timing"] = timing(args)
    if "reasoning_gym" in parts:
        out["runs"] += [reasoning_gym_run(args, name) for name in args.datasets.split(",")]
    if "textarena" in parts:
        out["runs"].append(textarena_run(args))
    out["comparison"] = [compare(run) for run in out["runs"]]
    out["plot"] = {"x": "step", "y": "greedy held-out success",
                   "series": {run["label"]: [[c["step"], c["success"]] for c in run["curve"]] for run in out["runs"]}}
    out["wall_seconds"] = time.perf_counter() - t0
    out["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out + ".json").write_text(json.dumps(out, indent=2))
    lines = markdown(args, out)
    Path(args.out + ".md").write_text("\n".join(lines))
    print("\n".join(lines), flush=True)
    for c in out["comparison"]:
        print(f"{c['env']}: {c['measure']} {c['base']:.1%} at step 0 -> {c['final']:.1%} at step {c['final_step']} "
              f"({c['gain'] * 100:+.1f} pts, target +{c['target_gain'] * 100:.0f}: {'met' if c['target_met'] else 'NOT met'}"
              f"{' (' + c['collapsed'] + ')' if c.get('collapsed') else ''}; "
              f"p = {c['p_value']:.3g})")
    print(f"total {out['wall_seconds']:.0f} s, peak RSS {out['peak_rss_mb']:.0f} MB", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
