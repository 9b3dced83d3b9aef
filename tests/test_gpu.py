"""The engine and the trainer on a CUDA device (`pytest -m gpu`; not in the default run).

Runs on a bare GPU Python: torch, transformers, peft, accelerate, numpy, pydantic and pytest (no
Prefect, Ray, MLflow or vLLM). Every test here needs a CUDA device and is skipped without one;
`OPENTINKER_GPU_TESTS_DEVICE=cpu` runs the same tests on the CPU, to check them before GPU time
is spent. What they hold, on the device:
- the engine contract of the HF engine (budgets, logprobs of the sampling distribution, greedy,
  stop tokens, LoRA version switch), float32 as on the CPU (1e-4);
- shared-prefix updates against the per-sequence path in bfloat16: gradients within 2% of the
  gradient norm (bf16 rounds activations to 8 bits of mantissa, and the two paths batch and pad
  differently, so their roundings differ), losses within 1e-2;
- two hosted jobs' updates in joint passes against each alone in bfloat16 (the same tolerance), and
  three Tinker clients' calls in one pass (shared, not split; log-probabilities within 5e-2);
- recomputed against sampled log-probabilities in bfloat16 within 3e-2 (device.py's tolerance);
- decode early stop: finished rows leave the batch and the samples stay those of `generate`;
- a LoRA RL job of SmolLM2-135M's shape (random weights) end to end: rollouts, updates, a
  checkpoint, trained weights and optimizer state float32.
"""

from __future__ import annotations

import copy
import json
import os

import pytest
import torch

from opentinker.backend import HFRolloutEngine, PolicyTrainer, SamplingParams
from opentinker.backend.device import Placement
from opentinker.core.spec import AlgorithmSpec, FullSpec, LoraSpec, OptimizationSpec
from tests import test_engine_contract as contract
from tests import test_stream_engine as stream
from tests import test_shared_prefix as shared_prefix
from tests.conftest import tiny_spec

ON = os.environ.get("OPENTINKER_GPU_TESTS_DEVICE", "cuda")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(ON == "cuda" and not torch.cuda.is_available(), reason="needs a CUDA device"),
]
DEVICE = torch.device(ON, 0) if ON == "cuda" else torch.device(ON)
BF16 = torch.bfloat16
GRADIENT_TOLERANCE = 2e-2  # of the gradient norm, bf16 (see the module's docstring)


def _on_device(model, dtype=torch.float32) -> Placement:
    model.to(DEVICE)
    return Placement(DEVICE, dtype)


# --- the engine contract, HF engine on the device ----------------------------------------------

@pytest.fixture
def engine_kind(monkeypatch):
    """The HF engine, its model moved to the device (the contract's own subjects, placed there)."""
    made_on_cpu = contract.make_subject

    def on_device(kind, model_name):
        made, close = made_on_cpu(kind, model_name)
        made.model.to(DEVICE)
        made.engine.placement = Placement(DEVICE, torch.float32)
        return made, close

    monkeypatch.setattr(contract, "make_subject", on_device)
    return "hf"


subject = contract.subject
test_tokens_respect_budgets_and_come_back_as_ids = contract.test_tokens_respect_budgets_and_come_back_as_ids
test_logprobs_are_those_of_the_sampling_distribution = contract.test_logprobs_are_those_of_the_sampling_distribution
test_greedy_is_the_argmax_and_repeatable = contract.test_greedy_is_the_argmax_and_repeatable
test_stop_tokens_end_a_completion_and_stay_in_the_record = contract.test_stop_tokens_end_a_completion_and_stay_in_the_record
test_a_lora_version_switch_changes_what_is_sampled = contract.test_a_lora_version_switch_changes_what_is_sampled


def test_the_engine_samples_on_the_device(subject):
    assert subject.model.device.type == DEVICE.type and subject.engine.placement.device == DEVICE
    assert subject.engine.generate(subject.prompts(), SamplingParams(max_new_tokens=4))


# --- shared-prefix updates against the per-sequence path, bf16 ---------------------------------

@pytest.fixture(scope="module")
def tiny(tiny_path):
    from opentinker.core.model_names import TINY
    from opentinker.model.policy import load_model

    return load_model(TINY)


def _bf16_pair(tiny_model, adapter):
    model, tok = tiny_model
    trainers = []
    for shared in (True, False):
        optim = OptimizationSpec(lr=1e-3, micro_batch_size=8, shared_prefix=shared)
        trainers.append(PolicyTrainer(copy.deepcopy(model), tok, adapter, AlgorithmSpec(), optim, placement=Placement(DEVICE, BF16)))
    if isinstance(adapter, LoraSpec):
        gen = torch.Generator().manual_seed(0)
        state = {k: torch.randn(v.shape, generator=gen) * 0.05 for k, v in trainers[0].trainable_state().items()}
        for t in trainers:
            t.load_trainable_state(state)
    return trainers


@pytest.mark.parametrize("adapter", [LoraSpec(r=4, alpha=8), FullSpec()], ids=["lora", "full"])
@pytest.mark.parametrize("records", ["single_turn", "multi_turn"])
def test_shared_prefix_gradients_agree_with_per_sequence_in_bf16(tiny, adapter, records):
    shared, per_sequence = _bf16_pair(tiny, adapter)
    trajs = getattr(shared_prefix, records)()
    (ga, ma), (gb, mb) = shared_prefix._gradients(shared, trajs), shared_prefix._gradients(per_sequence, trajs)
    assert ga.keys() == gb.keys() and ga
    assert {g.device.type for g in ga.values()} == {DEVICE.type} and {g.dtype for g in ga.values()} == {torch.float32}
    norm = float(torch.sqrt(sum((g.double() ** 2).sum() for g in gb.values())))
    worst = max(float((ga[k] - gb[k]).abs().max()) for k in ga)
    assert norm > 0 and worst <= GRADIENT_TOLERANCE * norm, f"largest gradient difference {worst:.3g} (norm {norm:.3g})"
    assert ma["update/policy_loss"] == pytest.approx(mb["update/policy_loss"], abs=1e-2)
    assert ma["update/shared_prefix"] == 1.0 and mb["update/shared_prefix"] == 0.0


# --- hosted jobs' updates in joint passes, bf16 --------------------------------------------------

def test_joint_passes_of_two_hosted_jobs_give_each_its_own_gradient_in_bf16(tiny):
    """Two adapters of one shared base on the device: their per-sequence micro-batches in joint
    passes (the base's runner) give each job the gradient of its own passes, within bf16's
    tolerance (the joint batch pads the rows wider), and the passes were shared."""
    import functools
    import threading

    from opentinker.backend.shared_base import SharedBase

    model, tok = tiny
    shared = SharedBase(copy.deepcopy(model), tok, "tiny", placement=Placement(DEVICE, BF16), gather_s=0.5, joint=True)
    optim = OptimizationSpec(lr=1e-3, micro_batch_size=4, shared_prefix=False)
    lora = LoraSpec(r=4, alpha=8, target_modules=["q_proj", "v_proj", "lm_head"])
    gen = torch.Generator().manual_seed(0)
    trainers, data = {}, {}
    for i, name in enumerate(("a", "b")):
        adapter = shared.add_job(name, lora.r, lora.alpha, lora.target_modules, 0.0, seed=i)
        trainers[name] = PolicyTrainer(adapter, tok, lora, AlgorithmSpec(), optim, placement=shared.placement)
        trainers[name].load_trainable_state({k: torch.randn(v.shape, generator=gen) * 0.05 for k, v in trainers[name].trainable_state().items()})
        data[name] = shared_prefix.single_turn(seed=i)

    def gradients(name):
        with trainers[name].model.using():
            return shared_prefix._gradients(trainers[name], data[name])

    alone = {name: gradients(name) for name in trainers}
    joint, barrier = {}, threading.Barrier(2)
    for name in trainers:
        trainers[name].joint = functools.partial(shared.joint_update, name)

    def run(name):
        barrier.wait()
        joint[name] = gradients(name)

    threads = [threading.Thread(target=run, args=(name,)) for name in trainers]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    for name in trainers:
        (ga, ma), (gb, mb) = joint[name], alone[name]
        assert ga.keys() == gb.keys() and {g.device.type for g in ga.values()} == {DEVICE.type}
        norm = float(torch.sqrt(sum((g.double() ** 2).sum() for g in gb.values())))
        worst = max(float((ga[k] - gb[k]).abs().max()) for k in ga)
        assert norm > 0 and worst <= GRADIENT_TOLERANCE * norm, f"{name}: largest gradient difference {worst:.3g} (norm {norm:.3g})"
        assert ma["update/policy_loss"] == pytest.approx(mb["update/policy_loss"], abs=1e-2)
        assert ma["update/joint_share"] > 0 and "update/joint_share" not in mb, (name, ma, shared.stats)


def test_tinker_tenants_share_one_pass_on_a_bf16_base(tiny):
    """Three Tinker clients' forward_backward calls (different ranks, losses and lengths) in one
    pass on the device in bf16: shared, not split into one call at a time, and each call's
    log-probabilities those of its call alone (bf16's tolerance)."""
    import threading

    import numpy as np

    from opentinker.backend.shared_base import SharedBase
    from tests import test_shared_base as tenants

    model, tok = tiny
    results = {}
    for gather in (0.0, 0.5):
        sb = SharedBase(copy.deepcopy(model), tok, "tiny", placement=Placement(DEVICE, BF16), gather_s=gather, joint=True)
        adapters, start = tenants._tenants(sb), threading.Barrier(len(tenants.TENANTS))

        def call(name: str, adapters=adapters, start=start, gather=gather) -> None:
            _, loss_fn, data = tenants.TENANTS[name]
            if gather:
                start.wait()
            results[gather, name] = adapters[name].forward_backward(data, loss_fn, {})

        if gather:
            threads = [threading.Thread(target=call, args=(name,)) for name in tenants.TENANTS]
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout=300)
            assert sb.stats.shared == 1 and sb.stats.split == 0, sb.stats
        else:
            for name in tenants.TENANTS:
                call(name)
    for name in tenants.TENANTS:
        for a, b in zip(results[0.5, name][0], results[0.0, name][0]):
            assert np.isfinite(a["logprobs"]).all() and np.allclose(a["logprobs"], b["logprobs"], atol=5e-2)


# --- recomputed against sampled log-probabilities, bf16 ----------------------------------------

def _sampled_against_recomputed(engine, trainer, tok) -> float:
    """The largest |sampled - recomputed| log-probability of 16 prompts' completions (16 tokens, T=1)."""
    from opentinker.core.trajectory import Trajectory

    prompts, where = stream._prompts(tok), trainer.placement
    completions = engine.generate(prompts, SamplingParams(max_new_tokens=16, temperature=1.0),
                                  generators=[torch.Generator(device=where.device).manual_seed(i) for i in range(len(prompts))])
    trajs = []
    for prompt, c in zip(prompts, completions):
        t = Trajectory(prompt_ids=prompt, group_id=0)
        t.append_sampled(c.token_ids, c.logprobs, "")
        trajs.append(t)
    recomputed = trainer.logprobs(trajs)
    return max(abs(a - b) for r, c in zip(recomputed, completions) for a, b in zip(r, c.logprobs))


@pytest.mark.parametrize("adapter", [LoraSpec(r=8, alpha=16), FullSpec()], ids=["lora", "full"])
def test_recomputed_logprobs_agree_with_sampled_ones_in_bf16(tiny, adapter):
    model, tok = tiny
    where = Placement(DEVICE, BF16)
    trainer = PolicyTrainer(copy.deepcopy(model), tok, adapter, AlgorithmSpec(), OptimizationSpec(lr=1e-3, micro_batch_size=8), placement=where)
    engine = HFRolloutEngine(trainer.model, tok, prefix_cache_tokens=0, placement=where)
    gap = _sampled_against_recomputed(engine, trainer, tok)
    assert gap < 3e-2, f"largest |recomputed - sampled| log-probability {gap:.3g}"


# --- continuous batching on the device ------------------------------------------------------------

@pytest.mark.parametrize("params", stream.PARAMS, ids=["t0.9", "top_p", "top_k", "greedy"])
def test_a_sequence_gets_the_same_alone_or_in_the_running_batch_on_the_device(tiny, params):
    """On the device as on the CPU (tests/test_stream_engine.py): each prompt's tokens alone and
    among the others (its own generator), logprobs within bf16's noise; rows leave when they end."""
    model, tok = tiny
    model = copy.deepcopy(model)
    engine = HFRolloutEngine(model, tok, prefix_cache_tokens=0, placement=_on_device(model))
    prompts, budgets = stream._prompts(tok), [stream.BUDGETS[i % 4] for i in range(16)]
    engine.stop_ids = stream._greedy_stops(engine, prompts) if params.greedy else stream._stops(tok, 9)

    def own(i: int) -> torch.Generator:
        return torch.Generator(device=DEVICE).manual_seed(100 + i)

    alone = [engine.generate([p], params, [b], generators=[own(i)])[0] for i, (p, b) in enumerate(zip(prompts, budgets))]
    before = (engine.decode_positions, engine.useful_positions)
    together = engine.generate(prompts, params, budgets, generators=[own(i) for i in range(16)])
    same = [c for c, d in zip(together, alone) if c.token_ids == d.token_ids]
    assert len(same) >= 14  # bf16: a wider batch's rounding may flip a near tie now and then
    assert max(abs(x - y) for c, d in zip(together, alone) if c.token_ids == d.token_ids for x, y in zip(c.logprobs, d.logprobs)) <= 5e-2
    assert engine.decode_positions - before[0] == engine.useful_positions - before[1] - 12  # 16 rows' prefill: 4 distinct prompts


# --- decoding as CUDA graphs over fixed slots -----------------------------------------------------

def test_decode_graphs_match_eager_decoding_and_follow_weight_changes(tiny):
    """The graph path (slots.py) against eager decoding in float32: the same greedy tokens, logprobs
    within 1e-4, rows joining a running batch; then weights changed between steps (an update, an
    adapter swap) reach the very next tokens: no graph reads stale weights."""
    from opentinker.backend.rollout import score_tokens

    model, tok = tiny
    model = copy.deepcopy(model)
    where = _on_device(model)
    graphs = HFRolloutEngine(model, tok, prefix_cache_tokens=0, placement=where, slots=True)
    eager = HFRolloutEngine(model, tok, prefix_cache_tokens=0, placement=where, slots=False)
    prompts, budgets = stream._prompts(tok), [stream.BUDGETS[i % 4] for i in range(16)]
    stops = stream._greedy_stops(eager, prompts)
    graphs.stop_ids = eager.stop_ids = stops
    greedy = SamplingParams(max_new_tokens=12, greedy=True)
    stream._same(graphs.generate(prompts, greedy, budgets), eager.generate(prompts, greedy, budgets))
    slots = graphs.stream.slots
    if DEVICE.type == "cuda":
        assert slots.replays > 0 and slots.captures > 0 and slots.eager_steps == 0
    graphs.stop_ids = []

    def perturb():
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(0)).to(p.device) * 0.05)

    graphs.stream.between_steps(perturb)
    (after,) = graphs.generate([prompts[0]], SamplingParams(max_new_tokens=8, greedy=True))
    fresh = score_tokens(model, where, prompts[0], after.token_ids)
    assert max(abs(a - b) for a, b in zip(after.logprobs, fresh)) < 1e-4


def test_a_merged_lora_adapter_decodes_what_the_trainer_scores_in_bf16(tiny):
    """LoRA decodes at the base's speed through weights with the adapter merged (slots.py): with a
    nonzero adapter in bf16, sampled logprobs agree with the trainer's recomputation (3e-2), and
    after a change of the adapter's weights the next samples follow the new adapter."""
    model, tok = tiny
    where = Placement(DEVICE, BF16)
    trainer = PolicyTrainer(copy.deepcopy(model), tok, LoraSpec(r=8, alpha=16), AlgorithmSpec(),
                            OptimizationSpec(lr=1e-3, micro_batch_size=8), placement=where)
    engine = HFRolloutEngine(trainer.model, tok, prefix_cache_tokens=0, placement=where, slots=True)

    for seed in (0, 1):
        gen = torch.Generator().manual_seed(seed)
        state = {k: torch.randn(v.shape, generator=gen) * 0.05 for k, v in trainer.trainable_state().items()}
        engine.stream.between_steps(lambda: trainer.load_trainable_state(state))
        worst = _sampled_against_recomputed(engine, trainer, tok)
        assert worst < 3e-2, f"adapter {seed}: largest |recomputed - sampled| log-probability {worst:.3g}"


# --- a LoRA RL job of SmolLM2-135M's shape, end to end --------------------------------------------

SMOLLM2_SHAPE = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                     max_position_embeddings=8192, rope_theta=100000.0, tie_word_embeddings=True, rms_norm_eps=1e-5)


@pytest.fixture(scope="module")
def smollm2_shape(tmp_path_factory):
    """A folder with a random-weight model of SmolLM2-135M-Instruct's shape and its real tokenizer."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from opentinker.model.loading import tokenizer_path

    folder = tmp_path_factory.mktemp("smollm2-shape")
    tok = AutoTokenizer.from_pretrained(tokenizer_path())
    config = LlamaConfig(vocab_size=len(tok), bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                         pad_token_id=tok.pad_token_id, **SMOLLM2_SHAPE)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)
    tok.save_pretrained(folder)
    return str(folder)


def test_a_lora_rl_job_of_smollm2_shape_runs_end_to_end(tmp_path, smollm2_shape):
    from opentinker.rl import RLJob

    gpus = 1 if DEVICE.type == "cuda" else 0
    spec = tiny_spec(tmp_path, model={"name": smollm2_shape, "dtype": "bfloat16"}, resources={"num_gpus": gpus},
                     rollout={"prompts_per_step": 8, "group_size": 4, "max_new_tokens": 16}, optimization={"steps": 2, "lr": 1e-4})
    job = RLJob(spec, job_id="gpu-smollm2-shape")
    assert job.policy.placement.device.type == DEVICE.type and job.policy.placement.compute_dtype == BF16
    job.rollout(0)
    batch = job.sampler.batch(0)
    trajs = [t for t in batch.trajectories if not t.failed and t.num_sampled]
    assert len(trajs) == 32
    recomputed = job.policy.trainer.logprobs(trajs)
    sampled = [[lp for lp, m in zip(t.sampling_logprobs, t.loss_mask) if m] for t in trajs]
    assert max(abs(a - b) for r, s in zip(recomputed, sampled) for a, b in zip(r, s)) < 3e-2
    before = {k: v.clone() for k, v in job.policy.trainer.trainable_state().items()}
    metrics = job.update(0)
    assert all(torch.isfinite(torch.tensor(v)) for k, v in metrics.items() if isinstance(v, float)), metrics
    after = job.policy.trainer.trainable_state()
    assert any(not torch.equal(before[k], after[k]) for k in before), "the update changed no adapter weight"
    params = dict(job.policy.model.named_parameters())
    assert {p.device.type for p in params.values()} == {DEVICE.type}
    assert {p.dtype for p in params.values() if p.requires_grad} == {torch.float32}
    assert {p.dtype for p in params.values() if not p.requires_grad and p.dim() > 1} == {BF16}
    assert all(s["exp_avg"].dtype == torch.float32 for s in job.policy.trainer.optimizer.state.values())
    ref = job.checkpoint(0)
    assert json.loads(json.dumps(str(ref)))  # a checkpoint was written and named
