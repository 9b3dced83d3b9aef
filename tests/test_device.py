"""Device placement and precision, on the CPU: the device a job gets, what `model.dtype` means,
where trained and frozen weights live, and the tolerance of recomputed log-probabilities."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import tiny_spec


def test_placement_follows_the_gpus_asked_for_and_the_dtype():
    from opentinker.backend.device import placement

    assert placement(0, "auto") == placement(0, "float32")  # the suite fixes `auto` on the CPU at float32 (conftest)
    assert placement(0, "auto").device.type == "cpu" and placement(0, "auto").compute_dtype == torch.float32
    assert placement(0, "bfloat16").compute_dtype == torch.bfloat16
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match=r"^resources.num_gpus: the job asks for 1 GPU\(s\); this process sees 0"):
            placement(1, "auto")


@pytest.mark.parametrize("forced, unit, expected", [("", "Intel AMX", torch.bfloat16), ("", "AVX-512 BF16", torch.bfloat16),
                                                     ("", None, torch.float32), ("float32", "Intel AMX", torch.float32),
                                                     ("bfloat16", None, torch.bfloat16)])
def test_auto_on_the_cpu_is_bfloat16_where_it_has_a_bfloat16_unit_unless_the_operator_fixes_it(monkeypatch, caplog, forced, unit, expected):
    from opentinker.backend import device

    monkeypatch.setenv(device.CPU_AUTO_ENV, forced)
    monkeypatch.setattr(device, "cpu_bf16_unit", lambda: unit)
    device.cpu_auto_choice.cache_clear()
    try:
        with caplog.at_level("INFO", logger=device.__name__):
            where = device.placement(0, "auto")
            device.placement(0, "auto")
        assert where.compute_dtype == expected and where.weights_dtype(trained=True) == torch.float32
        assert where.weights_dtype(trained=False) == expected
        lines = [r.getMessage() for r in caplog.records if r.name == device.__name__]
        reason = f"{device.CPU_AUTO_ENV} is set" if forced else (f"this CPU has {unit}" if unit else "no bfloat16 unit here")
        assert len(lines) == 1 and lines[0].startswith(f"model.dtype auto on the CPU: {str(expected)[6:]} (") and reason in lines[0]
        assert device.precision_line("auto", where) == lines[0]  # the job's log line (orchestration.actors)
        assert device.precision_line("float32", device.placement(0, "float32")) == "model.dtype float32 on the CPU"
        monkeypatch.setenv(device.CPU_AUTO_ENV, "float16")
        device.cpu_auto_choice.cache_clear()
        with pytest.raises(ValueError, match=rf"^{device.CPU_AUTO_ENV}='float16': float32 or bfloat16"):
            device.placement(0, "auto")
    finally:
        device.cpu_auto_choice.cache_clear()


def test_this_cpus_bfloat16_unit_is_what_its_flags_say():
    from opentinker.backend.device import cpu_bf16_unit

    flags = open("/proc/cpuinfo").read().split()
    want = "Intel AMX" if "amx_tile" in flags and "amx_bf16" in flags else "AVX-512 BF16" if "avx512_bf16" in flags else None
    assert cpu_bf16_unit() == want


def _recompute_gap(job) -> float:
    batch = job.sampler.batch(0)
    trajs = [t for t in batch.trajectories if not t.failed and t.num_sampled]
    recomputed = job.policy.trainer.logprobs(trajs)
    sampled = [[lp for lp, m in zip(t.sampling_logprobs, t.loss_mask) if m] for t in trajs]
    return max(abs(a - b) for r, s in zip(recomputed, sampled) for a, b in zip(r, s))


@pytest.mark.parametrize("dtype,tolerance", [("float32", 1e-4), ("bfloat16", 3e-2)])
def test_trained_weights_stay_float32_and_logprobs_agree_within_the_stated_tolerance(tmp_path, dtype, tolerance):
    """LoRA on a base in the compute precision: the base stored in it, the adapter and its
    optimizer state in float32; sampling and training share the autocast, so the trainer's
    recomputed log-probabilities match sampling's to the precision's rounding."""
    from opentinker.rl import RLJob

    job = RLJob(tiny_spec(tmp_path, model={"name": "tiny-random", "dtype": dtype}, optimization={"steps": 1}), job_id=f"dtype-{dtype}")
    params = dict(job.policy.model.named_parameters())
    assert {p.dtype for n, p in params.items() if p.requires_grad} == {torch.float32}
    assert {p.dtype for n, p in params.items() if not p.requires_grad and p.dim() > 1} == {getattr(torch, dtype)}
    job.rollout(0)
    assert _recompute_gap(job) < tolerance
    job.update(0)
    assert all(s["exp_avg"].dtype == torch.float32 for s in job.policy.trainer.optimizer.state.values())


class _Casts(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the casts dispatched while it is on."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func.overloadpacket is torch.ops.aten._to_copy
        return func(*args, **(kwargs or {}))


def test_a_bfloat16_lora_takes_its_input_as_autocast_casts_it_the_same_numbers_with_fewer_copies(tiny):
    """peft would cast each adapted projection's bfloat16 input to the adapter's float32 and
    autocast straight back: an exact round trip, so leaving it out must change no logprob and no
    gradient bit, and saves two casts per adapted projection and pass."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    from opentinker.backend import PolicyTrainer
    from opentinker.backend.device import Placement
    from opentinker.core.spec import AlgorithmSpec, LoraSpec, OptimizationSpec
    from opentinker.agent import ChatFormat, EpisodeLimits, run_episodes
    from opentinker.backend import HFRolloutEngine, SamplingParams
    from envs.toy import UppercaseGame
    from tests.test_trainer import _with_signal

    model, tok = tiny
    where = Placement(torch.device("cpu"), torch.bfloat16)
    trainer = PolicyTrainer(model, tok, LoraSpec(r=4), AlgorithmSpec(), OptimizationSpec(lr=1e-3, micro_batch_size=4), placement=where)
    torch.manual_seed(0)
    engine = HFRolloutEngine(trainer.model, tok, placement=where)  # sampled in the trainer's precision, as a job does
    try:
        trajs = _with_signal(run_episodes(engine, ChatFormat(tok), [UppercaseGame() for _ in range(8)],
                                          [{"prompt": f"Say something about item {i // 4}."} for i in range(8)],
                                          SamplingParams(max_new_tokens=4), EpisodeLimits(), [i // 4 for i in range(8)]))
    finally:
        engine.close()
    assert not any(t.failed for t in trajs)
    layers = [m for m in trainer.model.modules() if isinstance(m, BaseTunerLayer)]

    def scored() -> tuple[list, list, int]:
        casts = _Casts()
        with casts:
            trainer.compute_gradients(trajs)
        grads = [p.grad.clone() for p in trainer.params]
        trainer.optimizer.zero_grad(set_to_none=True)
        return trainer.logprobs(trajs), grads, casts.count

    assert layers and not any(m.cast_input_dtype_enabled for m in layers)
    lp, grads, casts = scored()
    for m in layers:
        m.cast_input_dtype_enabled = True  # peft's own way
    lp_peft, grads_peft, casts_peft = scored()
    assert lp == lp_peft and all(torch.equal(a, b) for a, b in zip(grads, grads_peft))
    assert casts_peft - casts >= 2 * len(layers)


class _WeightCasts(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts casts whose input is one of `weights` (by identity)."""

    def __init__(self, weights):
        super().__init__()
        self.ids, self.count = {id(w) for w in weights}, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (torch.ops.aten._to_copy, torch.ops.aten.to) and id(args[0]) in self.ids:
            self.count += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("slots", [False, True], ids=["growing", "slots"])
def test_decoding_casts_each_trained_weight_once_whatever_the_number_of_tokens(slots):
    """Full fine-tuning samples from float32 weights under bfloat16 autocast: the engine's busy
    stretch of steps is one autocast region, so each weight is cast once (autocast keeps the cast),
    not at every token (a region per step did: 37% of a decode step's GPU time, profiled on an H100).
    Over slots the decode copy holds the weights cast already (refilled by copy, not cast)."""
    from types import SimpleNamespace

    from transformers import Qwen2Config, Qwen2ForCausalLM

    from opentinker.backend import HFRolloutEngine, SamplingParams
    from opentinker.backend.device import Placement

    torch.manual_seed(0)
    config = Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=256, tie_word_embeddings=True)
    model = Qwen2ForCausalLM(config)  # float32, every weight trained
    tokens = SimpleNamespace(pad_token_id=0, eos_token_id=255)
    engine = HFRolloutEngine(model, tokens, max_batch_size=8, prefix_cache_tokens=0, placement=Placement(torch.device("cpu"), torch.bfloat16),
                             slots=slots)
    engine.stop_ids = []  # every row runs its whole budget
    weights = [p for p in model.parameters() if p.dim() == 2]
    counts = {}
    for new_tokens in (2, 8):
        casts = _WeightCasts(weights)
        engine.stream.on_thread(casts.__enter__).result()  # dispatch modes are per thread: the engine's
        # one request (one generator): its rows join together, so the stretch is one however slow
        # the caller (four requests, a loaded machine can finish the first before the last is queued)
        out = engine.generate([[1, 2, 3, 4]] * 2 + [[5, 6, 7]] * 2, SamplingParams(max_new_tokens=new_tokens),
                              generators=[torch.Generator().manual_seed(new_tokens)] * 4)
        engine.stream.on_thread(lambda: casts.__exit__(None, None, None)).result()
        assert all(len(c.token_ids) == new_tokens for c in out)
        counts[new_tokens] = casts.count
    assert counts[2] == counts[8] <= 2 * len(weights)  # the prefill's region and the loop's, each once
    assert counts[2] > 0 or slots
