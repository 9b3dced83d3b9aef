"""N tenants on one base vs. N separate servers: memory, throughput and step latency, same RL work, same run.

Each tenant is a Tinker client (the official SDK) that runs RL steps: sample `--samples` completions
of `--new-tokens` tokens from a `--prompt-len`-token prompt (its own sampler, from
`save_weights_and_get_sampling_client`), then `forward_backward` (importance_sampling on those
sequences, advantages +1/-1) and `optim_step`. A LoRA of rank 16 per tenant on SmolLM2-135M.

    shared:   one server process hosting every tenant's session (LocalSessions(shared_bases=True),
              what a base-model worker runs): one copy of the base for training and sampling;
              calls that arrive together (forward_backward; samples, unseeded) run as one batch
              across adapters.
    separate: one server process per tenant (LocalSessions as a session actor has it): a base
              for its trainer and one for its sampler each, and torch threads = cores // N (a
              session actor holds one CPU; with every core each, N processes' thread pools fight
              over the cores, as bench/shared_jobs.py measured).

Both are real processes (this script with `--serve`), started fresh for each N, the clients in
threads of this process. Measured: resident memory of the server processes (the sum of their RSS,
sampled every 0.5 s, the peak), aggregate tokens/s (sampled + trained tokens of all tenants over
the measured steps' wall time), each tenant's step latency (sample + update) p50/p95. After
`--warmup` steps per tenant, `--steps` are measured. The two ways alternate per N (separate
first, then shared).

    python bench/shared_base.py                         # N = 1, 2, 4, 8
    python bench/shared_base.py --tenants 1 2 --steps 2 --model tiny-random   # smoke run
    python bench/shared_base.py --tenants 2 --samples 32 --name shared_base_32   # 32 samples a step, results apart
writes bench/results/shared_base.{json,md} (NAME.{json,md} with --name)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
GOALS = {"memory_ratio": 0.4, "throughput_ratio": 1.3, "p95_latency_ratio": 1.0}  # at N = 4
CALLS = ("save_weights", "sample", "forward_backward", "optim_step")  # a tenant's RL step, timed call by call


def serve(tenants: list[str], shared: bool) -> None:
    """A server process: a gateway with its sessions in this process; prints URL and keys, serves until stdin closes."""
    from opentinker.control.gateway.tinker_local import local_gateway

    root = Path(tempfile.mkdtemp(prefix="shared-base-bench-"))
    url, keys, sessions, server = local_gateway(root, tenants=tuple(tenants), shared_bases=shared)
    print(json.dumps({"url": url, "keys": keys}), flush=True)
    sys.stdin.read()
    server.stop()
    sessions.close()


def _start(tenants: list[str], shared: bool, threads: int) -> tuple[subprocess.Popen, dict]:
    env = os.environ | {"TINKER_TELEMETRY": "0", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": str(threads)}
    proc = subprocess.Popen([sys.executable, __file__, "--serve", "shared" if shared else "own", *tenants], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    return proc, json.loads(proc.stdout.readline())


class Memory:
    """Peak of the summed RSS of some processes (and their children), sampled in a thread."""

    def __init__(self, pids: list[int]):
        import psutil

        self.procs = [psutil.Process(p) for p in pids]
        self.peak, self.stop = 0, threading.Event()
        self.thread = threading.Thread(target=self._watch, daemon=True)
        self.thread.start()

    def _watch(self) -> None:
        while not self.stop.is_set():
            total = 0
            for proc in self.procs:
                try:
                    total += sum(p.memory_info().rss for p in [proc, *proc.children(recursive=True)])
                except Exception:  # noqa: BLE001 - a process ending between two reads
                    pass
            self.peak = max(self.peak, total)
            self.stop.wait(0.5)

    def done(self) -> int:
        self.stop.set()
        self.thread.join()
        return self.peak


def compared(n: int, separate: dict, shared: dict) -> dict:
    """One row of the results (shared / separate ratios), printed as it comes."""
    row = {"tenants": n, "memory_ratio": shared["rss_mb"] / separate["rss_mb"],
           "throughput_ratio": shared["tokens_per_s"] / separate["tokens_per_s"],
           "p95_latency_ratio": shared["p95_s"] / separate["p95_s"], "shared": shared, "separate": separate}
    print(f"N={n}: memory {shared['rss_mb']:.0f} / {separate['rss_mb']:.0f} MB = {row['memory_ratio']:.2f}; "
          f"throughput {shared['tokens_per_s']:.0f} / {separate['tokens_per_s']:.0f} tok/s = {row['throughput_ratio']:.2f}; "
          f"p95 step {shared['p95_s']:.2f} / {separate['p95_s']:.2f} s = {row['p95_latency_ratio']:.2f}", flush=True)
    return row


def met_at_4(rows: list[dict]) -> dict[str, bool]:
    at4 = next((r for r in rows if r["tenants"] == 4), None)
    return {k: (at4[k] <= g if k != "throughput_ratio" else at4[k] >= g) for k, g in GOALS.items()} if at4 else {}


def table(rows: list[dict], first: str) -> list[str]:
    """The results as a markdown table; `first`: what the first column counts."""
    lines = [f"| {first} | memory shared / separate (MB) | ratio | tokens/s shared / separate | ratio | p95 step shared / separate (s) | ratio |",
             "|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        s, p = r["shared"], r["separate"]
        lines.append(f"| {r['tenants']} | {s['rss_mb']:.0f} / {p['rss_mb']:.0f} | **{r['memory_ratio']:.2f}** | {s['tokens_per_s']:.0f} / "
                     f"{p['tokens_per_s']:.0f} | **{r['throughput_ratio']:.2f}** | {s['p95_s']:.2f} / {p['p95_s']:.2f} | **{r['p95_latency_ratio']:.2f}** |")
    return lines


def tenant_loop(url: str, key: str, args, seed: int, out: dict) -> None:
    import numpy as np
    import tinker
    from tinker import types

    service = tinker.ServiceClient(base_url=url, api_key=key)
    trainer = service.create_lora_training_client(base_model=args.model, rank=16, seed=seed).result()
    rng = np.random.default_rng(seed)
    prompt = [int(t) for t in rng.integers(100, 5000, args.prompt_len)]
    latencies, tokens, started, calls = [], 0, None, {name: [] for name in CALLS}
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            out["ready"].wait()  # every tenant measured over the same span
            started = time.perf_counter()
        clock = [time.perf_counter()]

        def lap(name: str) -> None:
            clock.append(time.perf_counter())
            if step >= args.warmup:
                calls[name].append(clock[-1] - clock[-2])

        sampler = trainer.save_weights_and_get_sampling_client().result()
        lap("save_weights")
        result = sampler.sample(types.ModelInput.from_ints(prompt), args.samples,
                                types.SamplingParams(max_tokens=args.new_tokens, temperature=1.0, stop=[])).result()
        lap("sample")
        data = []
        for i, seq in enumerate(result.sequences):
            full = prompt + list(seq.tokens)
            n = len(full) - 1
            gen = len(seq.tokens)
            data.append(types.Datum(model_input=types.ModelInput.from_ints(full[:-1]), loss_fn_inputs={
                "target_tokens": full[1:], "logprobs": [0.0] * (n - gen) + list(seq.logprobs),
                "advantages": [0.0] * (n - gen) + [1.0 if i % 2 == 0 else -1.0] * gen}))
        clock.append(time.perf_counter())
        trainer.forward_backward(data, "importance_sampling").result()
        lap("forward_backward")
        trainer.optim_step(types.AdamParams(learning_rate=1e-4)).result()
        lap("optim_step")
        if step >= args.warmup:
            latencies.append(time.perf_counter() - clock[0])
            tokens += sum(len(s.tokens) for s in result.sequences) + sum(len(d.model_input.to_ints()) for d in data)
    for name, took in calls.items():
        out["calls"][name].extend(took)
    out["latencies"].extend(latencies)
    out["tokens"] += tokens
    out["spans"].append((started, time.perf_counter()))
    service.close("success")


def one_way(n: int, shared: bool, args) -> dict:
    tenants = [f"t{i}" for i in range(n)]
    cores = os.cpu_count() or 1
    servers = [_start(tenants, True, cores)] if shared else [_start([t], False, max(1, cores // n)) for t in tenants]
    memory = Memory([proc.pid for proc, _ in servers])
    keys = {t: (info["url"], info["keys"][t]) for _, info in servers for t in info["keys"]}
    out = {"latencies": [], "tokens": 0, "spans": [], "ready": _Gate(n), "calls": {name: [] for name in CALLS}}
    threads = [threading.Thread(target=_guarded, args=(tenant_loop, *keys[t], args, i, out)) for i, t in enumerate(tenants)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    peak = memory.done()
    for proc, _ in servers:
        proc.stdin.close()
        proc.wait(timeout=120)
    if out.get("error"):
        raise RuntimeError(out["error"])
    wall = max(e for _, e in out["spans"]) - min(s for s, _ in out["spans"])
    return {"rss_mb": peak / 2**20, "tokens_per_s": out["tokens"] / wall, "p50_s": quantile(out["latencies"], 0.5),
            "p95_s": quantile(out["latencies"], 0.95), "wall_s": wall, "calls_p50_s": {k: quantile(v, 0.5) for k, v in out["calls"].items()}}


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def where_the_time_goes(rows: list[dict]) -> list[str]:
    """A tenant's step by its calls (p50 each, shared / separate): which of them sharing speeds up or slows down."""
    lines = ["", "A tenant's step by its calls (p50 s, shared / separate):", "", "| tenants | " + " | ".join(CALLS) + " |",
             "|---:|" + "---:|" * len(CALLS)]
    for r in rows:
        s, p = r["shared"]["calls_p50_s"], r["separate"]["calls_p50_s"]
        lines.append(f"| {r['tenants']} | " + " | ".join(f"{s[c]:.2f} / {p[c]:.2f}" for c in CALLS) + " |")
    return lines


class _Gate:
    """Every tenant's thread waits here until all finished their warm-up."""

    def __init__(self, n: int):
        self.barrier = threading.Barrier(n)

    def wait(self) -> None:
        self.barrier.wait(timeout=1800)


def _guarded(fn, *a) -> None:
    try:
        fn(*a)
    except Exception as err:  # noqa: BLE001 - said once, at the end
        a[-1]["error"] = f"{type(err).__name__}: {err}"
        a[-1]["ready"].barrier.abort()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--serve", nargs="+", help=argparse.SUPPRESS)
    parser.add_argument("--tenants", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=24)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--name", default="shared_base", help="the results' name: bench/results/NAME.{json,md}")
    args = parser.parse_args()
    if args.serve:
        return serve(args.serve[1:], args.serve[0] == "shared")
    rows = [compared(n, one_way(n, False, args), one_way(n, True, args)) for n in args.tenants]  # separate first, then shared
    write_results(args.name, rows, args.model, {
        "steps": args.steps, "warmup": args.warmup, "samples": args.samples, "new_tokens": args.new_tokens, "prompt_len": args.prompt_len,
        "lora_rank": 16}, f"N tenants on one base vs. N separate servers ({args.model})",
        f"Each tenant: {args.steps} measured RL steps after {args.warmup} warm-up (sample {args.samples} x {args.new_tokens} tokens "
        f"from a {args.prompt_len}-token prompt, then importance_sampling forward_backward + optim_step, LoRA r16), through the "
        "tinker SDK. Shared: one server process, one base for all; separate: one process per tenant, torch threads = cores // N each.", "tenants",
        where_the_time_goes(rows))


def write_results(name: str, rows: list[dict], model: str, work: dict, title: str, what: str, first: str, more: list[str] = ()) -> None:
    """bench/results/NAME.{json,md}: the rows, the goals at N = 4 and whether they were met, the
    machine and the command; `more`: markdown lines after the goals."""
    import torch

    met = met_at_4(rows)
    machine = f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPU cores, torch {torch.__version__}"
    result = {"rows": rows, "goals_at_4": GOALS, "met_at_4": met, "model": model, "machine": machine, "work": work,
              "command": f"python bench/{Path(sys.argv[0]).name} " + " ".join(sys.argv[1:])}
    out = ROOT / "bench" / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n")
    lines = [f"# {title}", "", f"{machine}. {what}", "", *table(rows, first)]
    if met:
        lines += ["", "Goals at N = 4: memory <= 0.4x, throughput >= 1.3x, p95 step latency <= 1.0x: "
                  + ", ".join(f"{k} {'met' if v else 'not met'}" for k, v in met.items()) + "."]
    lines += [*more, "", f"Made with `{result['command']}`"]
    (out / f"{name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))

if __name__ == "__main__":
    main()
