"""Tinker's samplers through vLLM's multi-LoRA (opentinker.inference.engine_vllm_lora) against the
HF engine, on the same adapters of the same base, through `Samplers.sample` and the SDK's
SampleResponse: a real vLLM server (the test session's, tests/vllm_fixtures.py), in float32.
Skipped, with the reason, where vLLM cannot run."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from tinker.proto import tinker_public_pb2 as pb

from opentinker.backend.device import cpu
from opentinker.inference.engine_vllm_lora import VLLMAdapterEngine, sampling_engine_kind
from opentinker.tinker.sampling import SampleRequest, SamplerRecord, Samplers, SamplingEngines
from tests.rounding import same_logprobs

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _adapter(base: str, folder: Path, seed: int) -> Path:
    """A rank-8 peft adapter of every linear layer, lora_B drawn (seeded) so that it changes the answers."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = get_peft_model(AutoModelForCausalLM.from_pretrained(base), LoraConfig(r=8, lora_alpha=16, target_modules=TARGETS))
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.copy_(torch.randn(p.shape) * 0.1)
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def both(vllm_pool, vllm_tiny_path, tmp_path_factory):
    """(vLLM's samplers, the HF engine's samplers, the HF engine, the tokenizer): samplers "base", "a" and "b"."""
    from opentinker.inference.engine_hf import HFEngine

    tmp = tmp_path_factory.mktemp("tinker-vllm")
    folders = {"a": _adapter(vllm_tiny_path, tmp / "a", 1), "b": _adapter(vllm_tiny_path, tmp / "b", 2)}
    server = vllm_pool.get(vllm_tiny_path, "lora")
    vllm = VLLMAdapterEngine(server.url, "base", Path(vllm_tiny_path), api_key=server.api_key)  # the pool's server: the engine does not stop it
    hf = HFEngine.for_adapters(vllm_tiny_path, where=cpu())
    sides = []
    for engine, name in ((vllm, "vllm"), (hf, "hf")):
        samplers = Samplers(tmp / name, engines=SamplingEngines(factory=lambda _, engine=engine: engine))
        samplers.records["base"] = SamplerRecord("tiny", "tiny", None)
        for sampler, folder in folders.items():
            samplers.records[sampler] = SamplerRecord("tiny", "tiny", folder)
        sides.append(samplers)
    yield sides[0], sides[1], hf, vllm.tokenizer
    for samplers in sides:
        samplers.close()
    vllm.close()
    hf.close()


def _sample(samplers: Samplers, sampler: str, prompt: list[int], **kw) -> pb.SampleResponse:
    args = {"num_samples": 1, "max_tokens": 10, "temperature": 1.0, "top_k": -1, "top_p": 1.0, "seed": None, "stop": [],
            "prompt_logprobs": False, "topk_prompt_logprobs": 0} | kw
    return pb.SampleResponse.FromString(samplers.sample(SampleRequest(sampler, prompt, **args)))


def _ints(raw: bytes) -> list[int]:
    return np.frombuffer(raw, dtype="<i4").tolist()


def _floats(raw: bytes) -> np.ndarray:
    return np.frombuffer(raw, dtype="<f4")


def test_vllm_samples_each_tenants_adapter_as_the_hf_engine_does(both):
    """Greedy answers equal, sampled logprobs the model's (the HF engine's recompute of the same
    tokens, within float32's bound: tests/rounding.py), a seed repeats, each adapter answers as itself in one batch with the others,
    and prompt logprobs and top-k (scored by the engine's HF scorer on the same adapter) match."""
    vllm, hf_samplers, hf, tokenizer = both
    prompt = tokenizer("Tell me about the quick brown fox and the lazy dog")["input_ids"]
    greedy = {}
    for sampler in ("base", "a", "b"):
        got = [_sample(s, sampler, prompt, temperature=0.0, prompt_logprobs=True, topk_prompt_logprobs=3) for s in (vllm, hf_samplers)]
        tokens = [_ints(r.sequences[0].tokens) for r in got]
        assert tokens[0] == tokens[1] and len(tokens[0]) == 10, sampler
        greedy[sampler] = tokens[0]
        prompt_lp = [_floats(r.prompt_logprobs) for r in got]
        assert math.isnan(prompt_lp[0][0]) and len(prompt_lp[0]) == len(prompt)
        assert same_logprobs(prompt_lp[0][1:], prompt_lp[1][1:])  # vLLM's kernels against HF's: other orders
        tops = [np.frombuffer(r.topk_prompt_logprobs.token_ids, dtype=np.int32).reshape(len(prompt), -1) for r in got]
        assert tops[0].shape == (len(prompt), 3) and (tops[0][1:] == tops[1][1:]).all(), sampler  # scored by its HF scorer
    assert len({tuple(t) for t in greedy.values()}) == 3  # each adapter answers as itself

    seeded = _sample(vllm, "a", prompt, num_samples=3, seed=7)
    assert [_ints(s.tokens) for s in seeded.sequences] == [_ints(s.tokens) for s in _sample(vllm, "a", prompt, num_samples=3, seed=7).sequences]
    assert len({tuple(_ints(s.tokens)) for s in seeded.sequences}) > 1  # the samples of one call draw apart
    hf_samplers.pool.ensure_loaded("tiny", "a", hf_samplers.records["a"].folder)
    for s in seeded.sequences:
        tokens = _ints(s.tokens)
        recomputed, _ = hf.score_prompt(prompt + tokens, "a")
        assert same_logprobs(_floats(s.logprobs), recomputed[len(prompt):])


def test_vllm_stops_as_the_tinker_api_says(both):
    """A stop token ends a sample at its first occurrence and is kept; a stop string once its text
    appears, kept too; `[]` never stops."""
    vllm, _, _, tokenizer = both
    prompt = tokenizer("Once upon a time")["input_ids"]
    free = _ints(_sample(vllm, "b", prompt, max_tokens=16, seed=5).sequences[0].tokens)
    assert len(free) == 16
    stop = free[4]
    cut = _sample(vllm, "b", prompt, max_tokens=16, seed=5, stop=[stop]).sequences[0]
    assert _ints(cut.tokens) == free[: free.index(stop) + 1] and cut.stop_reason == pb.STOP_REASON_STOP
    text = tokenizer.decode(free)
    target = text[len(tokenizer.decode(free[:3])):][:2] or text[:2]
    stopped = _sample(vllm, "b", prompt, max_tokens=16, seed=5, stop=[target]).sequences[0]
    assert stopped.stop_reason == pb.STOP_REASON_STOP and target in tokenizer.decode(_ints(stopped.tokens))
    assert target not in tokenizer.decode(_ints(stopped.tokens)[:-1])


def test_an_adapter_folder_vllm_would_unpickle_or_too_wide_is_refused(both, tmp_path):
    vllm, _, _, _ = both
    engine = vllm.pool.engine("tiny")
    folder = Path(vllm.records["a"].folder)
    hostile = tmp_path / "hostile"
    hostile.mkdir()
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        (hostile / name).write_bytes((folder / name).read_bytes())
    (hostile / "new_embeddings.bin").write_bytes(b"\x80\x04not a tensor")  # vLLM would torch.load it
    with pytest.raises(ValueError, match="new_embeddings.bin, which vLLM would unpickle"):
        engine.load_adapter("hostile", str(hostile))
    assert "hostile" not in engine.adapters
    engine.max_rank = 4  # as a server started with --max-lora-rank 4 would take
    try:
        with pytest.raises(ValueError, match="rank 8 is above the 4 this vLLM server takes"):
            engine.load_adapter("too-wide", str(folder))
    finally:
        engine.max_rank = None
    with pytest.raises(KeyError):
        engine.generate([[1, 2, 3]], [4], None, adapter="hostile").result()


def test_where_tinker_samples_through_vllm():
    """`auto`: the HF engine on a CPU (vLLM's LoRA path is the slower there); `hf` anywhere."""
    assert sampling_engine_kind("auto", cpu()) == "hf"
    assert sampling_engine_kind("hf", cpu()) == "hf"


def test_the_tinker_sdk_samples_through_vllm_on_a_base_model_worker(vllm_pool, vllm_tiny_path, tmp_path, monkeypatch):
    """The unmodified SDK through the gateway, sessions sharing their bases (a base-model worker's
    way) with OPENTINKER_TINKER_SAMPLING_ENGINE=vllm: a sampler of a trained client samples through
    the base's vLLM engine, and its sampled logprobs equal (1e-4, float32) what compute_logprobs
    gives for the same tokens, which the shared base scores. The engine's server is the test
    session's (a start of its own is 20-30 s and 2.4 GB more; `start` is what the worker calls)."""
    import tinker
    from tinker import types

    from opentinker.control.gateway.tinker_local import local_gateway

    server = vllm_pool.get(vllm_tiny_path, "lora")
    started = []

    def start(cls, loader_name, where=None, max_rank=64, max_loras=16, scorer=None):
        started.append(loader_name)
        return cls(server.url, "base", Path(loader_name), api_key=server.api_key, where=where, scorer=scorer, max_rank=8)
    monkeypatch.setattr(VLLMAdapterEngine, "start", classmethod(start))
    models = tmp_path / "models"
    models.mkdir()
    (models / "tiny-h32").symlink_to(vllm_tiny_path)
    monkeypatch.setenv("OPENTINKER_MODEL_DIR", str(models))
    monkeypatch.setenv("OPENTINKER_TINKER_SAMPLING_ENGINE", "vllm")
    monkeypatch.setenv("OPENTINKER_VLLM_CPU_KV_CACHE_GIB", "1")
    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    url, keys, sessions, gateway = local_gateway(tmp_path / "state", tenants=("alice",), shared_bases=True)
    client = tinker.ServiceClient(base_url=url, api_key=keys["alice"])
    try:
        trainer = client.create_lora_training_client(base_model="tiny-h32", rank=8, seed=0).result()
        ids = list(range(5, 17))
        datum = types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]), loss_fn_inputs={"target_tokens": ids[1:], "weights": [1.0] * 11})
        trainer.forward_backward([datum], "cross_entropy").result()
        trainer.optim_step(types.AdamParams(learning_rate=5e-2)).result()
        sampler = trainer.save_weights_and_get_sampling_client().result()
        prompt = types.ModelInput.from_ints(ids[:6])
        out = sampler.sample(prompt, 2, types.SamplingParams(max_tokens=8, seed=3, stop=[])).result()
        assert started == [str(models / "tiny-h32")] and sessions.bases.sampler_engines is not sessions.bases.engines
        for seq in out.sequences:
            assert len(seq.tokens) == 8 and seq.stop_reason == "length"
            scored = sampler.compute_logprobs(types.ModelInput.from_ints(ids[:6] + seq.tokens)).result()
            assert same_logprobs(seq.logprobs, scored[6:])  # decoding against a prefill: other orders (tests/rounding.py)
        base = client.create_sampling_client(base_model="tiny-h32")
        assert base.sample(prompt, 1, types.SamplingParams(max_tokens=8, temperature=0.0, stop=[])).result().sequences[0].tokens != \
            sampler.sample(prompt, 1, types.SamplingParams(max_tokens=8, temperature=0.0, stop=[])).result().sequences[0].tokens
    finally:
        client.close("success") if hasattr(client, "close") else None
        gateway.stop()
        sessions.close()
