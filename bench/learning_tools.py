"""Learning curves of agents with real tools, SmolLM2-135M-Instruct (LoRA r16 + GRPO) on this CPU.

`--task code`: examples/code_interpreter_grpo.yaml. Arithmetic and word problems with a 3-digit by
2-digit product (envs.code_interpreter): the model may call the declared `python` tool, run in
the bubblewrap sandbox, and answer 'Answer: N'. Goal: held-out accuracy 25 points above step 0
within 40 steps, and at least 90% of the final step's tool calls well formed.

`--task mcp`: examples/mcp_units_grpo.yaml. Questions about made-up units whose factors only an
MCP server knows (envs.units; the bench starts `python -m envs.units.server` on a free port and
gives it as `env.tools: [{mcp: URL}]`). Without the tool, chance is about 0%. Goal: 60%.

SmolLM2's template renders no tools, so both use the hermes default format (opentinker/tools/
formats.py) with one example conversation. Prompted so, SmolLM2-135M never calls a tool (0 of 32
sampled episodes at step 1, and 0 of 64 greedy, measured: it writes the <tool_response> itself or
guesses), so RL has nothing to reinforce: `--warm-start N` first fine-tunes on N transcripts
(LoRA, one epoch, through opentinker's SFT job) that show the format on the *plain* problems only
("What is a * b + c?"; the code task) or on other numbers than the held-out ones (the MCP task),
and RL starts from that policy. Held-out problems are drawn apart from the training ones and
evaluated greedily every `--every` steps; step 0 is the warm-started policy.

    python bench/learning_tools.py --task code [--steps 40] [--every 5] [--eval-n 64] [--warm-start 300]
    python bench/learning_tools.py --task mcp [--steps 30] [--warm-start 300]
    python bench/learning_tools.py --task code --model tiny-random --steps 1 --every 1 --eval-n 4 --out /tmp/smoke
writes bench/results/learning_code_interpreter.{json,md} or bench/results/learning_mcp_units.{json,md} (or --out)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

TASKS = {
    "code": {"spec": "examples/code_interpreter_grpo.yaml", "out": "learning_code_interpreter", "goal": "+25 points within 40 steps",
             "game": "envs.code_interpreter:CodeInterpreterMathGame", "what": "3-digit x 2-digit arithmetic and word problems with a sandboxed python tool"},
    "mcp": {"spec": "examples/mcp_units_grpo.yaml", "out": "learning_mcp_units", "goal": "from chance (~0%) to at least 60%",
            "game": "envs.units:UnitsGame", "what": "made-up unit conversions only an MCP server knows"},
}


def split_tasks(game_path: str, seed: int, n_val: int, n_train: int = 2000) -> tuple[list[dict], list[dict]]:
    """(train, validation), drawn from the game's generator; no held-out question is ever trained on."""
    import numpy as np

    from opentinker.env.environment import import_game

    game = import_game(game_path)
    rng = np.random.default_rng(seed)
    val: dict[str, dict] = {}
    while len(val) < n_val:
        t = game.generate_task(rng)
        val.setdefault(t["question"], t)
    train = [t for t in (game.generate_task(rng) for _ in range(n_train)) if t["question"] not in val]
    return train, list(val.values())


def transcripts(task: str, train: list[dict], n: int, url: str | None) -> list[dict]:
    """SFT rows that call the tool the right way: the game's own prompt and tools, the call, the
    tool's true answer, then 'Answer: N'. The code task shows plain arithmetic only."""
    from opentinker.env.environment import import_game
    from opentinker.env.messages import initial_messages

    game = import_game(TASKS[task]["game"])()
    if task == "code":
        tools = [t.schema() for t in game.get_tools()]
        picked = [t for t in train if t["question"].startswith("What is ")][:n]
        calls = [("python", {"code": f"print({t['question'].removeprefix('What is ').removesuffix('?')})"}) for t in picked]
    else:
        from envs.units.table import unit
        from opentinker.core.env_hosts import EnvHosts
        from opentinker.tools.mcp import McpTools

        server = McpTools(url, EnvHosts.parse("127.0.0.1"), timeout_s=10)
        tools = [t.schema() for t in server.tools()]
        server.close()
        picked = train[:n]
        calls = []
        for t in picked:
            words = t["question"].removeprefix("How many ").removesuffix("?").split()  # <small>s are <value> <big>s
            calls.append(("convert", {"value": int(words[2]), "from_unit": unit(words[3]), "to_unit": unit(words[0])}))
    rows = []
    for t, (name, arguments) in zip(picked, calls):
        messages = initial_messages(game, game.reset(**t))
        messages += [{"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {"name": name, "arguments": arguments}}]},
                     {"role": "tool", "name": name, "content": str(t["answer"])}, {"role": "assistant", "content": f"Answer: {t['answer']}"}]
        rows.append({"messages": messages, "tools": tools})
    return rows


def warm_start(rows: list[dict], model: str, folder: str) -> tuple[str, dict]:
    """One epoch of LoRA SFT on the rows with opentinker's SFT job; (checkpoint URL, its result).
    `folder` outlives the run (runs/bench-warm-start/...): a rerun reuses the finished checkpoint."""
    from opentinker.sft.job import run_sft
    from opentinker.sft.spec import parse_sft_spec

    Path(folder).mkdir(parents=True, exist_ok=True)
    path = Path(folder) / "warm_start.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    spec = parse_sft_spec({"job_id": "warm-start", "model": {"name": model}, "adapter": {"kind": "lora", "r": 16, "alpha": 32},
                           "data": {"path": str(path), "eval_fraction": 0.05},
                           "training": {"epochs": 1, "lr": 1.0e-3, "batch_size": 8, "max_length": 1024, "seed": 0},
                           "storage": {"base_url": f"file://{folder}"}})
    result = run_sft(spec)
    return result["checkpoint"], result


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_units_server() -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "envs.units.server", "--port", str(port)], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return proc, f"http://127.0.0.1:{port}/mcp"
        except OSError:
            time.sleep(0.3)
    proc.kill()
    raise RuntimeError("the units MCP server did not start within 60 s")


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", choices=list(TASKS), required=True)
    parser.add_argument("--steps", type=int, default=None, help="default: the example spec's")
    parser.add_argument("--every", type=int, default=5)
    parser.add_argument("--eval-n", type=int, default=64)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None)
    parser.add_argument("--warm-start", type=int, default=0, help="SFT transcripts before RL (0: none)")
    parser.add_argument("--warm-start-checkpoint", default=None, help="the checkpoint an earlier run's warm start on the same rows made")
    args = parser.parse_args()
    task = TASKS[args.task]
    out_path = args.out or str(ROOT / "bench" / "results" / task["out"])

    import torch

    from opentinker.cli.common import quiet_libraries
    from opentinker.core.spec import load_spec, parse_spec
    from opentinker.inference.launch import rollout_server
    from opentinker.rl import RLJob

    quiet_libraries()
    torch.set_num_threads(os.cpu_count() or 1)
    train, val = split_tasks(task["game"], args.seed, args.eval_n)
    base = load_spec(str(ROOT / task["spec"])).model_dump(mode="json")
    server = None
    if args.task == "mcp":
        server, url = start_units_server()
        base["env"]["tools"] = [{"mcp": url, "timeout_s": 10}]
    steps = args.steps or base["optimization"]["steps"]
    warm: dict = {}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            if args.warm_start:
                rows = transcripts(args.task, train, args.warm_start, base["env"]["tools"][0]["mcp"] if server else None)
                t0 = time.perf_counter()
                if args.warm_start_checkpoint:  # the SFT of these same rows, made by an earlier run
                    checkpoint, result = args.warm_start_checkpoint, {}
                else:
                    checkpoint, result = warm_start(rows, args.model, str(ROOT / "runs" / "bench-warm-start" / f"{args.task}-{args.model}-{len(rows)}"))
                warm = {"transcripts": len(rows), "seconds": time.perf_counter() - t0, "example": rows[0], "reused": args.warm_start_checkpoint,
                        **{k: v for k, v in result.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}}
                base["model"] = base["model"] | {"init_from": checkpoint}
                print(f"warm start: {len(rows)} transcripts, {warm['seconds']:.0f} s", flush=True)
                asked = {r["messages"][-4]["content"] for r in rows}
                train = [t for t in train if t["question"] not in asked]  # RL and evaluation on problems SFT never showed
            base["env"]["config"] = {k: v for k, v in base["env"]["config"].items() if k != "val_size"} | {"dataset": train, "val_dataset": val}
            spec = parse_spec(base | {
                "model": base["model"] | {"name": args.model},
                "optimization": base["optimization"] | {"steps": steps},
                "evaluation": base["evaluation"] | {"every": args.every, "n_samples": len(val), "greedy": True},
                "checkpoint": base["checkpoint"] | {"every": 0, "base_url": f"file://{tmp}"},
                "seed": args.seed})
            print(f"{args.task}: {len(train)} training and {len(val)} held-out problems; {steps} steps, model {args.model}", flush=True)
            job = RLJob(spec, job_id=f"bench-learning-tools-{args.task}", start_server=rollout_server)  # vLLM samples, as in a job

            steps: list = []

            def on_step(r):
                m = r.metrics
                steps.append({"step": r.step, **m})
                print(f"step {r.step:>3}: reward {m['rollout/reward_mean']:.3f} tool calls {m.get('rollout/tool_call_rate', 0):.2f} "
                      f"valid {m.get('rollout/tool_valid_rate', 0):.2f} ({m['step/seconds']:.1f}s)", flush=True)

            evaluations: list = []

            def on_eval(e):
                evaluations.append(e)
                if len(evaluations) > 1:  # the curve so far, in case the run is stopped before its end
                    write(args, task, out_path, spec, Partial(evaluations, list(steps), time.perf_counter() - t_rl), val,
                          torch.__version__, warm, partial=True)
                m = e.metrics
                print(f"eval {e.step:>3}: accuracy {m.get('eval/accuracy', 0):.3f} tool calls {m.get('eval/tool_call_rate', 0):.3f} "
                      f"valid {m.get('eval/tool_valid_rate', 0):.3f}", flush=True)

            t_rl = time.perf_counter()
            result = job.run(on_step=on_step, on_eval=on_eval)
    finally:
        if server is not None:
            server.kill()
    write(args, task, out_path, spec, result, val, torch.__version__, warm)
    return 0


class Partial:
    """A run's evaluations and step metrics so far, shaped as its result."""

    def __init__(self, evaluations: list, history: list, seconds: float):
        self.evaluations, self.history, self.seconds = evaluations, history, seconds


def write(args, task, out_path, spec, result, val, torch_version, warm, partial: bool = False) -> None:
    keys = ("accuracy", "tool_call_rate", "tool_valid_rate", "tool_error_rate", "format_ok", "turns_mean")
    curve = [{"step": e.step, **{k: e.metrics.get(f"eval/{k}") for k in keys},
              "examples": [t.get("messages", t) for t in e.transcripts[:2]]} for e in result.evaluations]
    train_curve = [{"step": int(h.get("step") or 0), **{k: h.get(f"rollout/{k}") for k in keys + ("reward_mean",)}} for h in result.history]
    first, last = curve[0], curve[-1]
    final = train_curve[-1] if train_curve else {}
    best = max(curve, key=lambda c: c["accuracy"] or 0)
    verdict = (f"held-out accuracy {_pct(first['accuracy'])} at step {first['step']} -> {_pct(last['accuracy'])} at step {last['step']} "
               f"({100 * ((last['accuracy'] or 0) - (first['accuracy'] or 0)):+.1f} points; best {_pct(best['accuracy'])} at step {best['step']}); "
               f"the final training step's tool calls {_pct(final.get('tool_valid_rate'))} well formed (goal: {task['goal']})")
    times = sorted(h["step/seconds"] for h in result.history)
    command = (f"python bench/learning_tools.py --task {args.task} --steps {len(result.history)} --every {args.every} "
               f"--eval-n {len(val)}" + (f" --warm-start {warm['transcripts']}" if warm else "")
               + (f" --warm-start-checkpoint {warm['reused']}" if warm and warm.get("reused") else ""))
    data = {"command": command, "task": args.task, "spec": spec.model_dump(mode="json") | {"env": {"game": task["game"], "held_out": len(val)}},
            "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "torch": torch_version},
            "wall_seconds": result.seconds, "median_step_seconds": times[len(times) // 2] if times else None,
            "warm_start": warm, "curve": curve, "train_curve": train_curve, "verdict": verdict}
    Path(out_path).parent.mkdir(parents=True, exist_ok=True)
    Path(out_path + ".json").write_text(json.dumps(data, indent=2, default=str))
    head = "| step | accuracy | tool-call rate | calls well formed | tool errors | answered | turns |"
    lines = [f"# Learning with tools: {args.model}, {task['what']}, LoRA r16 + GRPO (CPU)", "",
             f"`{command}`; "
             f"{task['spec']}, hermes tool format, one example conversation, "
             + (f"SFT warm start on {warm['transcripts']} transcripts ({warm_made(warm)}; step 0 is that policy). " if warm else "no SFT warm start. ")
             + f"Wall time {result.seconds:.0f} s "
             f"(median step {data['median_step_seconds'] or 0:.1f} s).", "", "Greedy, held-out:", "", head, "|---:|---:|---:|---:|---:|---:|---:|"]
    row = lambda c: (f"| {c['step']} | {_pct(c['accuracy'])} | {_pct(c['tool_call_rate'])} | {_pct(c['tool_valid_rate'])} | "
                     f"{_pct(c['tool_error_rate'])} | {_pct(c['format_ok'])} | {c['turns_mean'] or 0:.2f} |")
    lines += [row(c) for c in curve]
    lines += ["", "Sampled training rollouts (temperature 1):", "", head.replace("| turns |", "| turns | reward |"),
              "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    lines += [row(c) + f" {c['reward_mean'] or 0:.3f} |" for c in train_curve]
    lines += ["", f"Verdict: {verdict}" + (" (the run was stopped here; these are its evaluations so far)" if partial else ""), ""]
    Path(out_path + ".md").write_text("\n".join(lines))
    print("\n".join(lines), flush=True)


def warm_made(warm: dict) -> str:
    if warm.get("reused"):
        return "the checkpoint an earlier run of the same command made from the same rows, reused"
    return f"{warm['seconds']:.0f} s"


if __name__ == "__main__":
    sys.exit(main())
