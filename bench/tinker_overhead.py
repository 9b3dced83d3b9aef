"""What serving the Tinker API costs: the same work through the official `tinker` SDK against
OpenTinker vs. done in this process with plain torch + peft / transformers, in the same run.

(1) Training step. LoRA r16 (alpha 32, dropout 0, on q,k,v,o,gate,up,down and lm_head) on the
    base model, 8 sequences of 128 tokens (random token ids from a seeded generator; targets are
    the next tokens, weights all 1), cross-entropy = -sum(w * logprob), AdamW(lr 1e-4, betas
    (0.9, 0.95), eps 1e-12). Way A: `forward_backward` + `optim_step` through the SDK (SDK ->
    gateway -> session server, two HTTP hops, the sessions run in this process: see
    opentinker.control.gateway.tinker_local). Way B: get_peft_model, logits -> log_softmax ->
    gather -> -sum -> backward -> AdamW step -> zero_grad. Seconds per step; goal A / B <= 1.05.
(2) Sampling. 8 samples x 32 new tokens from one 64-token prompt (random ids), temperature 1,
    no stop (every sample runs 32 tokens). Way A: `sampling_client.sample(prompt, num_samples=8)`
    (the sampling client from `save_weights_and_get_sampling_client()`). Way B: transformers'
    `model.generate(prompt repeated 8 times, do_sample=True, max_new_tokens=32, min_new_tokens=32,
    top_k=0)` on a peft-wrapped copy of the same base. Generated tokens per second; goal A / B >= 2.
    Way C: the merged model's own forward (weights as transformers stores them) in a bare loop
    (prompt prefilled once, the same sampling): what any server of that forward can reach. The
    service's engine multiplies with oneDNN-packed weights (opentinker/backend/packed_linear.py,
    the same float32 arithmetic in another summation order), so A can pass C.

Each way is warmed up (`--warmup`, 2), then run `--steps` times (`--rounds` for sampling), the two ways
alternating (A, B, A, B, ...) so machine noise hits both alike; medians are reported. Torch uses
os.cpu_count() threads for both (they share this process). For the SDK way the server-side compute
(the trainer's forward_backward + optim_step; the sampling engine's generate) is timed too, so the
table shows what the protocol adds on top of it. The per-step losses of both ways are printed: the
LoRA starts from the same seed, so they should agree.

    python bench/tinker_overhead.py                                  # SmolLM2-135M, 10 steps
    python bench/tinker_overhead.py --model tiny-random --steps 3    # smoke run
writes bench/results/tinker_overhead.{json,md}
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

LORA_R, LORA_ALPHA = 16, 32
TARGET_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"]
LR, BETAS, EPS = 1e-4, (0.9, 0.95), 1e-12
SEQS, SEQ_LEN = 8, 128
SAMPLES, NEW_TOKENS, PROMPT_LEN = 8, 32, 64
TRAIN_GOAL, SAMPLE_GOAL = 1.05, 2.0


class ServerClock:
    """Seconds spent inside wrapped methods (the session's compute), read and reset per step."""

    def __init__(self):
        self.lock = threading.Lock()
        self.seconds = 0.0

    def wrap(self, cls, name: str) -> None:
        inner = getattr(cls, name)
        clock = self

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                with clock.lock:
                    clock.seconds += time.perf_counter() - t0

        setattr(cls, name, timed)

    def take(self) -> float:
        with self.lock:
            seconds, self.seconds = self.seconds, 0.0
        return seconds


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


# -- way B: plain torch + peft / transformers in this process ----------------------------------
def load_peft(model_name: str, seed: int):
    """The base from the same local folder the session loads, in float32, LoRA-wrapped by peft."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from opentinker.model.loading import resolve_model

    base = AutoModelForCausalLM.from_pretrained(resolve_model(model_name), dtype=torch.float32)
    torch.manual_seed(seed)  # the adapter's A matrices, as the session seeds them
    config = LoraConfig(r=LORA_R, lora_alpha=LORA_ALPHA, lora_dropout=0.0, target_modules=list(TARGET_MODULES), task_type="CAUSAL_LM")
    return get_peft_model(base, config)


class InProcessTrainer:
    def __init__(self, model_name: str, inputs, targets, weights):
        import torch

        self.model = load_peft(model_name, seed=0)
        self.model.train()
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=LR, betas=BETAS, eps=EPS, weight_decay=0.0)
        self.inputs, self.targets, self.weights = inputs, targets, weights

    def step(self) -> tuple[float, float]:
        """(seconds, loss) of one step."""
        import torch

        t0 = time.perf_counter()
        logits = self.model(input_ids=self.inputs).logits
        logprobs = torch.log_softmax(logits.float(), dim=-1).gather(-1, self.targets[..., None]).squeeze(-1)
        loss = -(self.weights * logprobs).sum()
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad()
        seconds = time.perf_counter() - t0
        return seconds, float(loss.detach())


class InProcessSampler:
    def __init__(self, model_name: str, prompt: list[int]):
        import torch

        self.model = load_peft(model_name, seed=1)
        self.model.eval()
        self.input_ids = torch.tensor([prompt] * SAMPLES, dtype=torch.long)
        self.attention = torch.ones_like(self.input_ids)
        config = self.model.get_base_model().config
        self.pad = config.pad_token_id if config.pad_token_id is not None else config.eos_token_id

    def round(self) -> tuple[float, int]:
        """(seconds, generated tokens) of one round."""
        t0 = time.perf_counter()
        out = self.model.generate(input_ids=self.input_ids, attention_mask=self.attention, do_sample=True, temperature=1.0,
                                  top_k=0, top_p=1.0, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, pad_token_id=self.pad)
        seconds = time.perf_counter() - t0
        return seconds, int((out.shape[1] - self.input_ids.shape[1]) * out.shape[0])


class BareLoop:
    """The floor for sampling on this machine: the model's own forward in a plain loop (the LoRA
    merged, the prompt prefilled once for all samples, then one token per step for the batch with
    the same sampling: log-softmax, a multinomial draw, the drawn token's logprob), no engine, no
    batching thread, no HTTP. How far way A is from it is all that serving adds."""

    def __init__(self, model_name: str, prompt: list[int]):
        import torch

        self.model = load_peft(model_name, seed=1).merge_and_unload()
        self.model.eval()
        self.prompt = torch.tensor([prompt], dtype=torch.long)

    def round(self) -> tuple[float, int]:
        import torch

        t0 = time.perf_counter()
        with torch.no_grad():
            cache = self.model(input_ids=self.prompt[:, :-1], use_cache=True).past_key_values
            cache.reorder_cache(torch.zeros(SAMPLES, dtype=torch.long))
            token = self.prompt[:, -1:].repeat(SAMPLES, 1)
            drawn = 0
            for i in range(NEW_TOKENS):
                out = self.model(input_ids=token, past_key_values=cache, use_cache=True, logits_to_keep=1,
                                 position_ids=torch.full((SAMPLES, 1), PROMPT_LEN - 1 + i))
                cache = out.past_key_values
                logp = torch.log_softmax(out.logits[:, -1].float(), dim=-1)
                token = torch.multinomial(logp.exp(), 1)
                logp.gather(-1, token).tolist()
                drawn += SAMPLES
        return time.perf_counter() - t0, drawn


# -- way A: the tinker SDK against a local gateway ------------------------------------------------
class SdkTrainer:
    def __init__(self, tc, types, data, pipeline: bool, clock: ServerClock):
        self.tc, self.types, self.data, self.pipeline, self.clock = tc, types, data, pipeline, clock
        self.adam = types.AdamParams(learning_rate=LR, beta1=BETAS[0], beta2=BETAS[1], eps=EPS)

    def step(self) -> tuple[float, float, float]:
        """(seconds, server compute seconds, loss) of one step."""
        self.clock.take()
        t0 = time.perf_counter()
        fb = self.tc.forward_backward(self.data, "cross_entropy")
        if self.pipeline:  # the SDK's idiom: submit both, then wait (optim_step runs after forward_backward)
            opt = self.tc.optim_step(self.adam)
            out = fb.result()
        else:
            out = fb.result()
            opt = self.tc.optim_step(self.adam)
        opt.result()
        seconds = time.perf_counter() - t0
        return seconds, self.clock.take(), float(out.metrics["loss:sum"])


class SdkSampler:
    def __init__(self, sampling_client, types, prompt: list[int], clock: ServerClock):
        self.client, self.clock = sampling_client, clock
        self.prompt = types.ModelInput.from_ints(prompt)
        self.params = types.SamplingParams(max_tokens=NEW_TOKENS, temperature=1.0, top_k=-1, top_p=1.0, stop=[])

    def round(self) -> tuple[float, float, int]:
        """(seconds, server compute seconds, generated tokens) of one round."""
        self.clock.take()
        t0 = time.perf_counter()
        response = self.client.sample(self.prompt, num_samples=SAMPLES, sampling_params=self.params).result()
        seconds = time.perf_counter() - t0
        lengths = [len(s.tokens) for s in response.sequences]
        if lengths != [NEW_TOKENS] * SAMPLES:
            raise RuntimeError(f"SDK samples have {lengths} tokens, expected {SAMPLES} x {NEW_TOKENS} (stop=[] must never stop)")
        return seconds, self.clock.take(), sum(lengths)


# -- the run --------------------------------------------------------------------------------------
def run(args) -> dict:
    import torch

    from opentinker.backend.primitives import PrimitiveModel
    from opentinker.backend.rollout import HFRolloutEngine
    from opentinker.control.gateway.tinker_local import local_gateway

    clock = ServerClock()
    clock.wrap(PrimitiveModel, "forward_backward")
    clock.wrap(PrimitiveModel, "optim_step")
    clock.wrap(HFRolloutEngine, "generate")

    with tempfile.TemporaryDirectory() as tmp:
        url, keys, sessions, server = local_gateway(Path(tmp))
        os.environ.update(TINKER_BASE_URL=url, TINKER_API_KEY=keys["alice"], TINKER_TELEMETRY="0")
        import tinker
        from tinker import types

        try:
            t0 = time.perf_counter()
            service = tinker.ServiceClient()
            # wait for the session's model before loading ours: two from_pretrained at once in one process are not thread-safe
            tc = service.create_lora_training_client(base_model=args.model, rank=LORA_R, seed=0).result()
            setup = {"sdk_create_training_client_s": time.perf_counter() - t0}
            print(f"SDK training client: {setup['sdk_create_training_client_s']:.1f}s", flush=True)

            from transformers import AutoConfig

            from opentinker.model.loading import resolve_model

            vocab = AutoConfig.from_pretrained(resolve_model(args.model)).vocab_size
            gen = torch.Generator().manual_seed(args.seed)
            ids = torch.randint(0, vocab, (SEQS, SEQ_LEN + 1), generator=gen)
            prompt = torch.randint(0, vocab, (PROMPT_LEN,), generator=gen).tolist()
            inputs, targets = ids[:, :-1].contiguous(), ids[:, 1:].contiguous()
            weights = torch.ones(SEQS, SEQ_LEN)
            data = [types.Datum(model_input=types.ModelInput.from_ints(inputs[i].tolist()),
                                loss_fn_inputs={"target_tokens": targets[i].tolist(), "weights": weights[i].tolist()})
                    for i in range(SEQS)]

            t0 = time.perf_counter()
            local = InProcessTrainer(args.model, inputs, targets, weights)
            setup["inprocess_load_s"] = time.perf_counter() - t0
            sdk = SdkTrainer(tc, types, data, not args.no_pipeline, clock)

            train = {"sdk_s": [], "sdk_server_s": [], "sdk_loss": [], "inprocess_s": [], "inprocess_loss": []}
            for i in range(args.warmup + args.steps):
                a_s, a_server, a_loss = sdk.step()
                b_s, b_loss = local.step()
                counted = i >= args.warmup
                if counted:
                    train["sdk_s"].append(a_s)
                    train["sdk_server_s"].append(a_server)
                    train["inprocess_s"].append(b_s)
                train["sdk_loss"].append(a_loss)
                train["inprocess_loss"].append(b_loss)
                print(f"train {'step' if counted else 'warm-up'} {i + 1}: SDK {a_s:.3f}s (server compute {a_server:.3f}s) "
                      f"loss {a_loss:.4f} | in-process {b_s:.3f}s loss {b_loss:.4f}", flush=True)

            t0 = time.perf_counter()
            sampling_client = tc.save_weights_and_get_sampling_client().result()
            setup["sdk_sampling_client_s"] = time.perf_counter() - t0
            del local
            t0 = time.perf_counter()
            gen_local = InProcessSampler(args.model, prompt)
            bare = BareLoop(args.model, prompt)
            setup["inprocess_generate_load_s"] = time.perf_counter() - t0
            sdk_sampler = SdkSampler(sampling_client, types, prompt, clock)

            sample = {"sdk_s": [], "sdk_server_s": [], "sdk_tokens": [], "generate_s": [], "generate_tokens": [], "bare_s": [], "bare_tokens": []}
            for i in range(args.warmup + args.rounds):
                a_s, a_server, a_tok = sdk_sampler.round()
                b_s, b_tok = gen_local.round()
                c_s, c_tok = bare.round()
                counted = i >= args.warmup
                if counted:
                    for key, value in (("sdk_s", a_s), ("sdk_server_s", a_server), ("sdk_tokens", a_tok),
                                       ("generate_s", b_s), ("generate_tokens", b_tok), ("bare_s", c_s), ("bare_tokens", c_tok)):
                        sample[key].append(value)
                print(f"sample {'round' if counted else 'warm-up'} {i + 1}: SDK {a_tok / a_s:.0f} tok/s ({a_s:.3f}s, server compute "
                      f"{a_server:.3f}s) | generate {b_tok / b_s:.0f} tok/s ({b_s:.3f}s) | bare loop {c_tok / c_s:.0f} tok/s", flush=True)
            service.close("success")
        finally:
            server.stop()
            sessions.close()
    return {"train": train, "sample": sample, "setup": setup}


def summarize(raw: dict) -> list[dict]:
    t, s = raw["train"], raw["sample"]
    a, b = _median(t["sdk_s"]), _median(t["inprocess_s"])
    server = _median(t["sdk_server_s"])
    loss_gap = max(abs(x - y) / max(abs(y), 1e-9) for x, y in zip(t["sdk_loss"], t["inprocess_loss"]))
    train_row = {"measurement": "training step", "unit": "s/step", "better": "lower",
                 "sdk": a, "inprocess": b, "ratio": a / b, "goal": f"<= {TRAIN_GOAL}", "met": a / b <= TRAIN_GOAL,
                 "sdk_server_compute": server, "sdk_overhead_ms": (a - server) * 1000, "max_relative_loss_gap": loss_gap,
                 "sdk_all": t["sdk_s"], "sdk_server_all": t["sdk_server_s"], "inprocess_all": t["inprocess_s"],
                 "sdk_losses": t["sdk_loss"], "inprocess_losses": t["inprocess_loss"]}
    a_rates = [n / x for n, x in zip(s["sdk_tokens"], s["sdk_s"])]
    b_rates = [n / x for n, x in zip(s["generate_tokens"], s["generate_s"])]
    a, b = _median(a_rates), _median(b_rates)
    sample_row = {"measurement": "sampling", "unit": "generated tok/s", "better": "higher",
                  "sdk": a, "inprocess": b, "ratio": a / b, "goal": f">= {SAMPLE_GOAL}", "met": a / b >= SAMPLE_GOAL,
                  "sdk_server_compute": _median(s["sdk_server_s"]),
                  "sdk_overhead_ms": (_median(s["sdk_s"]) - _median(s["sdk_server_s"])) * 1000,
                  "sdk_all": a_rates, "sdk_seconds_all": s["sdk_s"], "sdk_server_all": s["sdk_server_s"],
                  "inprocess_all": b_rates, "inprocess_seconds_all": s["generate_s"]}
    c_rates = [n / x for n, x in zip(s["bare_tokens"], s["bare_s"])]
    sample_row |= {"bare_loop": _median(c_rates), "sdk_over_bare_loop": a / _median(c_rates),
                   "generate_over_bare_loop": b / _median(c_rates), "bare_loop_all": c_rates}
    return [train_row, sample_row]


def table(rows: list[dict]) -> list[str]:
    lines = ["| measurement | A: tinker SDK -> gateway -> session | B: in-process (torch + peft / generate) | ratio A / B | goal | met |",
             "|---|---:|---:|---:|---:|:---:|"]
    for r in rows:
        fmt = (lambda x: f"{x:.3f} s/step") if r["unit"] == "s/step" else (lambda x: f"{x:.0f} tok/s")
        lines.append(f"| {r['measurement']} | {fmt(r['sdk'])} | {fmt(r['inprocess'])} | **{r['ratio']:.3f}** | {r['goal']} "
                     f"| {'yes' if r['met'] else 'no'} |")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct", help="a served base model (smollm2-135m-instruct, tiny-random)")
    parser.add_argument("--steps", type=int, default=10, help="timed training steps per way (after 2 warm-up steps)")
    parser.add_argument("--rounds", type=int, default=None, help="timed sampling rounds per way (default: --steps)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps / rounds per way before the timed ones")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random token ids")
    parser.add_argument("--no-pipeline", action="store_true",
                        help="wait for forward_backward before sending optim_step (default: send both, then wait)")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "tinker_overhead"))
    args = parser.parse_args()
    args.rounds = args.rounds or args.steps
    if args.steps < 1 or args.rounds < 1 or args.warmup < 0:
        parser.error("--steps and --rounds: at least 1; --warmup: 0 or more")

    from importlib.metadata import version

    import peft
    import torch
    import transformers

    from opentinker.cli.common import quiet_libraries

    quiet_libraries()
    torch.set_num_threads(os.cpu_count() or 1)
    raw = run(args)
    rows = summarize(raw)
    command = "python bench/tinker_overhead.py " + " ".join(sys.argv[1:])
    settings = {"model": args.model, "steps": args.steps, "rounds": args.rounds, "warmup": args.warmup, "seed": args.seed,
                "pipeline": not args.no_pipeline, "lora": {"r": LORA_R, "alpha": LORA_ALPHA, "dropout": 0.0, "target_modules": TARGET_MODULES},
                "adamw": {"lr": LR, "betas": list(BETAS), "eps": EPS, "weight_decay": 0.0},
                "train_batch": {"sequences": SEQS, "tokens": SEQ_LEN, "loss": "cross_entropy", "weights": 1.0},
                "sampling": {"samples": SAMPLES, "new_tokens": NEW_TOKENS, "prompt_tokens": PROMPT_LEN, "temperature": 1.0,
                             "top_k": "off", "top_p": 1.0, "stop": "never"},
                "dtype": "float32", "device": "cpu"}
    machine = {"cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
               "transformers": transformers.__version__, "peft": peft.__version__, "tinker": version("tinker"),
               "python": platform.python_version(), "platform": platform.platform()}
    result = {"command": command, "settings": settings, "machine": machine, "setup_seconds": raw["setup"], "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out + ".json").write_text(json.dumps(result, indent=2))

    train, sample = rows
    about = (f"{args.model} fp32 on {os.cpu_count()} CPU cores (torch {torch.__version__}, {torch.get_num_threads()} threads), "
             f"LoRA r{LORA_R} alpha {LORA_ALPHA} on {', '.join(TARGET_MODULES)}. Training: {SEQS} x {SEQ_LEN} random tokens, "
             f"cross-entropy, AdamW lr {LR}; `forward_backward` + `optim_step` "
             f"({'sent together, then awaited' if settings['pipeline'] else 'awaited one by one'}) vs. torch + peft. "
             f"Sampling: {SAMPLES} x {NEW_TOKENS} new tokens from one {PROMPT_LEN}-token prompt, T=1, no stop; "
             f"`SamplingClient.sample` vs. `model.generate` on a peft model. Medians of {args.steps} steps / {args.rounds} rounds "
             f"after {args.warmup} warm-ups each, the two ways alternating.")
    compute = (f"SDK way, server-side compute (median): training {train['sdk_server_compute']:.3f} s/step "
               f"(overhead on top {train['sdk_overhead_ms']:.0f} ms/step), sampling {sample['sdk_server_compute']:.3f} s/round "
               f"(overhead on top {sample['sdk_overhead_ms']:.0f} ms/round). Losses of the two ways agree to "
               f"{train['max_relative_loss_gap']:.1e} (relative, all steps).")
    floor = (f"C, a bare decode loop of the merged model's own forward (weights as transformers stores them) in this process, "
             f"alternating with A and B: {sample['bare_loop']:.0f} tok/s; A / C = **{sample['sdk_over_bare_loop']:.3f}**, "
             f"B / C = {sample['generate_over_bare_loop']:.3f}. The service's engine multiplies with oneDNN-packed weights "
             f"(float32, its sampled logprobs still equal the trainer's to 1e-4), which is how A passes C.")
    steps = ("All training steps (s): SDK " + ", ".join(f"{x:.3f}" for x in train["sdk_all"])
             + "; in-process " + ", ".join(f"{x:.3f}" for x in train["inprocess_all"]) + "  \n"
             + "All sampling rounds (tok/s): SDK " + ", ".join(f"{x:.0f}" for x in sample["sdk_all"])
             + "; generate " + ", ".join(f"{x:.0f}" for x in sample["inprocess_all"])
             + "; bare loop " + ", ".join(f"{x:.0f}" for x in sample["bare_loop_all"]))
    body = [*table(rows), "", compute, "", floor, "", steps, "", f"Made with `{command}`"]
    title = f"# Tinker API overhead: official SDK vs. in-process, same work, same run ({args.model})"
    Path(args.out + ".md").write_text("\n".join([title, "", about, "", *body, ""]))
    print()
    print("\n".join(body))
    return 0


if __name__ == "__main__":
    sys.exit(main())
