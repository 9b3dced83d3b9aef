"""One contract for every rollout engine: the in-process transformers engine, the engine that
samples through an OpenAI-compatible server (against our own CPU server here), and vLLM's real
server, on this CPU or a GPU, taking a version as an adapter by name or as merged weights reloaded
in place (skipped, with the reason, where vLLM cannot run). Tokens, logprobs against the trainer's
recompute, stop conditions, and a switch of version."""

from __future__ import annotations

import itertools
import json
import shutil
from pathlib import Path

import pytest
import torch

from opentinker.backend import HFRolloutEngine, SamplingParams
from opentinker.backend.device import Placement, cpu
from opentinker.backend.rollout import score_tokens
from opentinker.backend.server_engine import Probe, ServerHandle, ServerRolloutEngine, SyncError
from opentinker.core.spec import LoraSpec
from opentinker.model import adapter_files, load_model, wrap_model
from opentinker.model.adapters import lora_factors
from tests.rounding import TINY_LOGPROB, logprob_gap

# Largest |logprob - recompute| per engine: ours run the trainer's own code in float32, vLLM's
# CPU kernels the same float32 sums in other orders, so both within float32's bound for the tiny
# model's pass (tests/rounding.py); a GPU's vLLM computes in its own precision: 1e-2.
FLOAT32 = logprob_gap(TINY_LOGPROB)
TOLERANCE = {"hf": FLOAT32, "server": FLOAT32, "vllm": 1e-2 if torch.cuda.is_available() else FLOAT32}
TOLERANCE["vllm_merged"] = TOLERANCE["vllm"]
PROMPTS = ["The capital of France is", "1 2 3 4 5", "Once upon a time, in a land far away, there was"]
LORA = LoraSpec(r=8, alpha=16)
_SUBJECTS = itertools.count()  # names each subject's adapters apart on a shared server


class Subject:
    """An engine under test, and the trainer-side model whose weights it must sample from."""

    def __init__(self, engine, model, tokenizer, publish):
        self.engine, self.model, self.tokenizer, self._publish = engine, model, tokenizer, publish

    def prompts(self) -> list[list[int]]:
        return [self.tokenizer(p)["input_ids"] for p in PROMPTS]

    def publish(self, version: int) -> None:
        """Make the engine sample from `self.model`'s current weights as policy `version`."""
        self._publish(version)


def _perturb(model, seed: int) -> None:
    """Give the LoRA adapter weights that change the model's answers (B starts at zero)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)


def _model_folder(tmp_path, tiny_path, stop_token: int | None = None):
    """The tiny model; with `stop_token`, a copy whose generation config also ends at that token."""
    if stop_token is None:
        return str(tiny_path)  # vLLM's kinds share the session's servers on it with the other modules
    tmp_path.mkdir(parents=True, exist_ok=True)
    folder = tmp_path / "model"
    if not folder.exists():
        shutil.copytree(tiny_path, folder)
    if stop_token is not None:
        config = json.loads((folder / "generation_config.json").read_text())
        eos = config.get("eos_token_id")
        config["eos_token_id"] = sorted({*(eos if isinstance(eos, list) else [eos]), stop_token} - {None})
        (folder / "generation_config.json").write_text(json.dumps(config))
    return str(folder)


def make_subject(kind: str, model_name: str, pool=None):
    base, tokenizer = load_model(model_name)
    model = wrap_model(base, LORA)
    if kind == "hf":
        engine = HFRolloutEngine(model, tokenizer, prefix_cache_tokens=0)

        def publish(version: int) -> None:  # shares the model: the handshake is the version
            engine.policy_version = version

        return Subject(engine, model, tokenizer, publish), lambda: None
    if kind == "server":
        from opentinker.inference.engine_hf import HFEngine
        from opentinker.inference.server import create_app, serve_in_thread

        served = HFEngine.for_adapters(model_name)
        running = serve_in_thread(create_app(served, "base", api_key="k", max_tokens_cap=64), "127.0.0.1", 0, close=served.close)
        engine = ServerRolloutEngine(ServerHandle(running.url, "base", "k", running.stop), tolerance=TOLERANCE["server"])
        probe = Probe(tokenizer("a probe")["input_ids"], lambda p, t: score_tokens(model, cpu(), p, t))

        def publish(version: int) -> None:
            engine.sync_adapter(version, adapter_files(model), probe)

        return Subject(engine, model, tokenizer, publish), engine.close
    if kind in ("vllm", "vllm_merged"):  # vLLM's server as a job's own: adapters by name, or their factors merged by the server in place
        gpus = int(torch.cuda.is_available())
        model = model.cuda() if gpus else model
        merged = kind == "vllm_merged"
        server = pool.get(model_name, "merged" if merged else "lora")
        engine = ServerRolloutEngine(server.handle("merged" if merged else "lora", owned=False), tolerance=TOLERANCE["vllm"],
                                     adapter_prefix=f"s{next(_SUBJECTS)}")
        where = Placement(torch.device("cuda", 0), torch.float32) if gpus else cpu()
        probe = Probe(tokenizer("a probe")["input_ids"], lambda p, t: score_tokens(model, where, p, t))

        def publish(version: int) -> None:
            if merged:
                engine.sync_weights(version, lora_factors(model), probe).result()
            else:
                engine.sync_adapter(version, adapter_files(model), probe)

        return Subject(engine, model, tokenizer, publish), engine.close
    raise AssertionError(kind)


@pytest.fixture
def model_folders(tmp_path_factory, tiny_path, engine_kind, request):
    """The tiny model's folder (for vLLM the tiny model with heads of 32, the smallest its CPU attention
    takes), and one whose generation config also stops at `stop_token`, made once per kind and token."""
    source = request.getfixturevalue("vllm_tiny_path") if engine_kind.startswith("vllm") else tiny_path
    root = tmp_path_factory.getbasetemp() / f"engine-models-{Path(str(source)).name}"
    return lambda stop_token=None: _model_folder(root / str(stop_token), source, stop_token)


@pytest.fixture(params=["hf", "server", "vllm", "vllm_merged"])
def engine_kind(request):
    return request.param


@pytest.fixture
def pool(engine_kind, request):
    """The session's vLLM servers for the vLLM kinds (skipped where vLLM cannot run)."""
    return request.getfixturevalue("vllm_pool") if engine_kind.startswith("vllm") else None


@pytest.fixture
def subject(engine_kind, model_folders, pool):
    made, close = make_subject(engine_kind, model_folders(), pool)
    made.publish(0)
    made.kind = engine_kind
    yield made
    close()


def _recompute(subject, prompt, completion) -> list[float]:
    return score_tokens(subject.model, Placement(subject.model.device, torch.float32), prompt, completion.token_ids)


def _gap(subject, prompt, completion) -> float:
    return max(abs(a - b) for a, b in zip(completion.logprobs, _recompute(subject, prompt, completion)))


def test_tokens_respect_budgets_and_come_back_as_ids(subject):
    prompts = subject.prompts()
    budgets = [3, 7, 1]
    completions = subject.engine.generate(prompts, SamplingParams(max_new_tokens=6), budgets)
    vocab = len(subject.tokenizer)
    for c, b in zip(completions, budgets):
        assert 1 <= len(c.token_ids) <= min(b, 6) and len(c.logprobs) == len(c.token_ids)
        assert all(isinstance(t, int) and 0 <= t < vocab for t in c.token_ids)
        assert c.finish_reason in ("stop", "length")
        if c.finish_reason == "length":
            assert len(c.token_ids) == min(b, 6)
    assert subject.engine.policy_version == 0


def test_logprobs_are_those_of_the_sampling_distribution(subject):
    """Sampled at temperature 1: each token's logprob is the trainer's recompute (float32: TOLERANCE);
    at temperature 0.5 they are log softmax(logits / 0.5), not the raw ones."""
    prompts = subject.prompts()
    for c, p in zip(subject.engine.generate(prompts, SamplingParams(max_new_tokens=5)), prompts):
        assert _gap(subject, p, c) < TOLERANCE[subject.kind]
    cold = subject.engine.generate(prompts[:1], SamplingParams(max_new_tokens=5, temperature=0.5))[0]
    ids = torch.tensor([prompts[0] + cold.token_ids], device=subject.model.device)
    with torch.no_grad():
        logits = subject.model(input_ids=ids).logits[0, len(prompts[0]) - 1 : -1].float().cpu() / 0.5
    expected = torch.log_softmax(logits, -1).gather(-1, torch.tensor(cold.token_ids)[:, None]).squeeze(-1)
    assert torch.allclose(torch.tensor(cold.logprobs), expected, atol=TOLERANCE[subject.kind])


def test_greedy_is_the_argmax_and_repeatable(subject):
    prompts = subject.prompts()
    first = subject.engine.generate(prompts, SamplingParams(max_new_tokens=6, greedy=True))
    again = subject.engine.generate(prompts, SamplingParams(max_new_tokens=6, greedy=True))
    assert [c.token_ids for c in first] == [c.token_ids for c in again]
    with torch.no_grad():
        ids = torch.tensor([prompts[1] + first[1].token_ids], device=subject.model.device)
        argmax = subject.model(input_ids=ids).logits[0, len(prompts[1]) - 1 : -1].argmax(-1).tolist()
    assert first[1].token_ids == argmax[: len(first[1].token_ids)]


def test_a_lora_version_switch_changes_what_is_sampled(subject):
    """New adapter weights published as version 1, then 2: completions follow each, carry the
    version, and match the trainer's recompute of the weights of that version."""
    prompts = subject.prompts()
    before = subject.engine.generate(prompts, SamplingParams(max_new_tokens=6, greedy=True))
    for version in (1, 2):
        _perturb(subject.model, seed=version)
        subject.publish(version)
        after = subject.engine.generate(prompts, SamplingParams(max_new_tokens=6, greedy=True))
        assert subject.engine.policy_version == version
        for c, p in zip(after, prompts):
            assert _gap(subject, p, c) < TOLERANCE[subject.kind]
        assert [c.token_ids for c in after] != [c.token_ids for c in before]
        before = after


def test_stop_tokens_end_a_completion_and_stay_in_the_record(engine_kind, model_folders, pool):
    """A token of the model's generation config ends the completion (finish 'stop'), and the
    token is the record's last, with its logprob. (vLLM reads the stop tokens the same whichever way it
    takes weights: one of its two ways here, a server less to start.)"""
    if engine_kind == "vllm_merged":
        pytest.skip("vLLM's stop tokens are checked with kind 'vllm': the same server code")
    plain, close = make_subject(engine_kind, model_folders(), pool)
    prompt = plain.prompts()[0]
    greedy = plain.engine.generate([prompt], SamplingParams(max_new_tokens=6, greedy=True))[0].token_ids
    close()
    stop_token = greedy[2]
    stopping, close = make_subject(engine_kind, model_folders(stop_token), pool)
    stopping.publish(0)
    try:
        c = stopping.engine.generate([prompt], SamplingParams(max_new_tokens=6, greedy=True))[0]
        cut = greedy.index(stop_token) + 1
        assert (c.token_ids, c.finish_reason, len(c.logprobs)) == (greedy[:cut], "stop", cut)
    finally:
        close()
        if pool is not None:
            pool.discard(model_folders(stop_token))  # no other test samples this folder


# --- the server engine's sync is verified, not trusted ---------------------------------------


@pytest.fixture
def server_subject(tmp_path, tiny_path):
    made, close = make_subject("server", _model_folder(tmp_path, tiny_path))
    made.publish(0)
    yield made
    close()


def _listed(engine) -> set[str]:
    return {m["id"] for m in engine.client.get("/v1/models").json()["data"]}


def test_versions_are_named_listed_and_the_old_one_unloaded(server_subject):
    engine = server_subject.engine
    assert engine.served == "policy-v0" and _listed(engine) == {"base", "policy-v0"}
    _perturb(server_subject.model, seed=1)
    server_subject.publish(1)
    assert engine.served == "policy-v1" and _listed(engine) == {"base", "policy-v1"}


def test_a_failed_adapter_load_is_a_sync_error(server_subject):
    engine = server_subject.engine
    files = adapter_files(server_subject.model)
    files["adapter/adapter_model.safetensors"] = b"not a safetensors file"
    probe = Probe(server_subject.prompts()[0], lambda p, t: score_tokens(server_subject.model, cpu(), p, t))
    with pytest.raises(SyncError, match="refused adapter policy-v1"):
        engine.sync_adapter(1, files, probe)
    assert engine.served == "policy-v0" and engine.policy_version == 0  # still sampling the last verified version


def test_a_stale_adapter_is_a_sync_error(server_subject):
    """The server takes the load but serves older weights (here: version 0's files under the new
    name, as a server that caches adapters by path would): the probe tells."""
    engine = server_subject.engine
    stale = adapter_files(server_subject.model)
    _perturb(server_subject.model, seed=1)
    probe = Probe(server_subject.prompts()[0], lambda p, t: score_tokens(server_subject.model, cpu(), p, t))
    with pytest.raises(SyncError, match="stale"):
        engine.sync_adapter(1, stale, probe)
    assert engine.served == "policy-v0"
    engine.sync_adapter(2, adapter_files(server_subject.model), probe)  # the true weights pass
    assert engine.served == "policy-v2"


def test_bfloat16_server_and_trainer_agree_within_the_stated_tolerance(tmp_path, tiny_path):
    """The default tolerance in bfloat16 (0.1 mean |Δlogprob|) holds between our server and a
    trainer in the same precision, so a bf16 job's syncs pass; float32's is 1e-3."""
    from opentinker.inference.engine_hf import HFEngine
    from opentinker.inference.server import create_app, serve_in_thread
    from opentinker.rl.sampler import sync_tolerance
    from tests.conftest import tiny_spec

    where = Placement(torch.device("cpu"), torch.bfloat16)
    spec = tiny_spec(tmp_path, rollout={"engine": "server"})
    assert sync_tolerance(spec, where) == 0.1 and sync_tolerance(spec, cpu()) == 1e-3
    base, tokenizer = load_model(_model_folder(tmp_path, tiny_path))
    model = wrap_model(base.to(torch.bfloat16), LORA)
    _perturb(model, seed=4)
    served = HFEngine.for_adapters(_model_folder(tmp_path, tiny_path), where=where)
    running = serve_in_thread(create_app(served, "base", max_tokens_cap=64), "127.0.0.1", 0, close=served.close)
    engine = ServerRolloutEngine(ServerHandle(running.url, "base", None, running.stop), tolerance=sync_tolerance(spec, where))
    try:
        gap = engine.sync_adapter(1, adapter_files(model), Probe(tokenizer(PROMPTS[2])["input_ids"], lambda p, t: score_tokens(model, where, p, t)))
        assert gap < 0.1
    finally:
        engine.close()
