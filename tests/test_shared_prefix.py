"""Shared-prefix updates: a group's common prefix runs once and its completions against it, with the
loss and gradients of scoring every record whole (optimization.shared_prefix off)."""

import copy
import random

import pytest
import torch

from opentinker.backend import PolicyTrainer
from opentinker.backend.shared_prefix import common_prefix_length, plan
from opentinker.core.spec import AlgorithmSpec, FullSpec, KLSpec, LoraSpec, OptimizationSpec
from opentinker.core.trajectory import Trajectory
from tests.rounding import PASS, same_adam_step, same_grad, same_update_metrics, update_bounds

VOCAB = 2000  # token ids drawn below this (the tiny model's vocabulary is the real tokenizer's)


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(10, VOCAB) for _ in range(n)]


def _sample(t: Trajectory, ids: list[int], rng: random.Random) -> None:
    t.append_sampled(ids, [-rng.uniform(0.5, 3.0) for _ in ids], action="")


def single_turn(seed=0, groups=3, group_size=4, lengths=((2, 9), (1, 3), (5, 12))):
    """Groups with their own prompt (of different lengths) and completions of unequal lengths."""
    rng = random.Random(seed)
    out = []
    for g in range(groups):
        prompt = _tokens(rng, 20 + 7 * g)
        lo, hi = lengths[g % len(lengths)]
        for i in range(group_size):
            t = Trajectory(prompt_ids=list(prompt), group_id=g)
            _sample(t, _tokens(rng, rng.randint(lo, hi)), rng)
            t.turns[-1].reward = float((i + g) % 3 == 0) + 0.1 * i
            out.append(t)
    return out


def multi_turn(seed=1, group_size=4):
    """Group 0: a common first turn (action and observation), then differing turns; group 1: the
    prompt in common only, differing from the first action on."""
    rng = random.Random(seed)
    out = []
    for g in range(2):
        prompt = _tokens(rng, 18)
        first, observation = _tokens(rng, 4), _tokens(rng, 6)
        for i in range(group_size):
            t = Trajectory(prompt_ids=list(prompt), group_id=g)
            _sample(t, first if g == 0 else _tokens(rng, rng.randint(2, 6)), rng)
            t.append_observation(observation if g == 0 else _tokens(rng, 5), "")
            _sample(t, _tokens(rng, rng.randint(1, 7)), rng)
            t.append_observation(_tokens(rng, 3), "")
            _sample(t, _tokens(rng, rng.randint(2, 5)), rng)
            for j, turn in enumerate(t.turns):
                turn.reward = float((i + j) % 2) * 0.5
            out.append(t)
    return out


def identical_samples(seed=2):
    """A group whose samples are all the same record (its shared prefix is the whole record)."""
    rng = random.Random(seed)
    prompt, answer = _tokens(rng, 15), _tokens(rng, 5)
    out = []
    for i in range(3):
        t = Trajectory(prompt_ids=list(prompt), group_id=7)
        t.append_sampled(answer, [-1.0 - 0.1 * k for k in range(5)], action="")
        t.turns[-1].reward = float(i)
        out.append(t)
    return out


@pytest.fixture(scope="module")
def tiny(tiny_path):
    """One tiny random model for the module: every trainer below works on its own copy."""
    from opentinker.core.model_names import TINY
    from opentinker.model.policy import load_model

    return load_model(TINY)


def _pair(tiny_model, adapter, algorithm, micro_batch_size=8):
    """Two trainers with the same weights (a LoRA adapter with non-zero B, so that every adapter
    weight has a gradient), one scoring against shared prefixes and one per sequence."""
    model, tok = tiny_model
    trainers = []
    for shared in (True, False):
        optim = OptimizationSpec(lr=1e-3, micro_batch_size=micro_batch_size, shared_prefix=shared)
        trainers.append(PolicyTrainer(copy.deepcopy(model), tok, adapter, algorithm, optim))
    if isinstance(adapter, LoraSpec):
        gen = torch.Generator().manual_seed(0)
        state = {k: torch.randn(v.shape, generator=gen) * 0.05 for k, v in trainers[0].trainable_state().items()}
        for t in trainers:
            t.load_trainable_state(state)
    assert trainers[0].shares_prefixes() and not trainers[1].shares_prefixes()
    return trainers


def _gradients(trainer, trajs):
    metrics = trainer.compute_gradients(trajs)
    return {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.requires_grad and p.grad is not None}, metrics


def _assert_same(shared, per_sequence, trajs):
    bounds = update_bounds(per_sequence, trajs)
    (ga, ma), (gb, mb) = _gradients(shared, trajs), _gradients(per_sequence, trajs)
    assert ga.keys() == gb.keys() and ga and any(float(g.abs().max()) > 0 for g in gb.values())
    # the same sums in another order (a prefix once against each record whole): tests/rounding.py
    assert all(same_grad(ga[k], gb[k]) for k in ga), [k for k in ga if not same_grad(ga[k], gb[k])]
    assert same_update_metrics(ma, mb, bounds)
    assert ma["update/positions_trained"] == mb["update/positions_trained"] == sum(t.num_sampled for t in trajs)
    assert ma["update/shared_prefix"] == 1.0 and mb["update/shared_prefix"] == 0.0
    return ma, mb


@pytest.mark.parametrize("adapter", [LoraSpec(r=4, alpha=8), FullSpec()], ids=["lora", "full"])
@pytest.mark.parametrize("advantage", ["grpo", "rloo"])
@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean"])
def test_shared_prefix_gradients_equal_per_sequence(tiny, adapter, advantage, aggregation):
    algorithm = AlgorithmSpec(advantage=advantage, loss_aggregation=aggregation)
    shared, per_sequence = _pair(tiny, adapter, algorithm)
    trajs = single_turn()
    ma, mb = _assert_same(shared, per_sequence, trajs)
    # the prompt of each group ran once instead of once per sample, and nothing was padded
    assert ma["update/positions_computed"] == sum(20 + 7 * g for g in range(3)) + sum(t.num_sampled for t in trajs)
    assert mb["update/positions_computed"] > 2.5 * ma["update/positions_computed"]


@pytest.mark.parametrize("adapter", [LoraSpec(r=4, alpha=8), FullSpec()], ids=["lora", "full"])
@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean"])
def test_multi_turn_records_share_their_common_first_turn(tiny, adapter, aggregation):
    shared, per_sequence = _pair(tiny, adapter, AlgorithmSpec(advantage="rloo", loss_aggregation=aggregation))
    trajs = multi_turn()
    packs = plan([t.token_ids for t in trajs], [t.group_id for t in trajs], micro_batch_size=8)
    assert [p.prefix_lengths for p in packs] == [[18 + 4 + 6, 18]]
    _assert_same(shared, per_sequence, trajs)


@pytest.mark.parametrize("adapter", [LoraSpec(r=4, alpha=8), FullSpec()], ids=["lora", "full"])
def test_groups_split_into_rows_backpropagate_the_prefix_once_with_the_same_gradient(tiny, adapter):
    """micro_batch_size 3 < group size 4: a group's completions run as two packed rows against
    one prefix, whose backward runs once with what both rows sent it."""
    shared, per_sequence = _pair(tiny, adapter, AlgorithmSpec(), micro_batch_size=3)
    trajs = single_turn(seed=4) + multi_turn(seed=5)
    assert any(len(p.rows) > 1 for p in plan([t.token_ids for t in trajs], [t.group_id for t in trajs], 3))
    _assert_same(shared, per_sequence, trajs)


@pytest.mark.parametrize("adapter", [LoraSpec(r=4, alpha=8), FullSpec()], ids=["lora", "full"])
def test_kl_to_the_reference_is_scored_against_shared_prefixes_too(tiny, adapter):
    shared, per_sequence = _pair(tiny, adapter, AlgorithmSpec(kl=KLSpec(coef=0.3, estimator="k3")))
    if isinstance(adapter, FullSpec):  # move the policy away from its reference so the KL has a gradient
        for t in (shared, per_sequence):
            with torch.no_grad():
                for i, p in enumerate(t.params):
                    p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(i)) * 0.02)
    ma, _ = _assert_same(shared, per_sequence, single_turn(seed=6) + identical_samples())
    assert ma["update/kl"] > 1e-6


def test_records_identical_to_their_shared_prefix_and_unrelated_groups(tiny):
    """Edge cases: a group of identical records (nothing left after the prefix) and records whose
    group shares no token at all (an empty prefix: everything packed)."""
    shared, per_sequence = _pair(tiny, LoraSpec(r=4, alpha=8), AlgorithmSpec(normalize_std=False))
    trajs = identical_samples() + single_turn(seed=8, groups=2)
    trajs[-1].token_ids[0] = trajs[-2].token_ids[0] + 1  # the last group's records now differ from their first token
    trajs[-1].group_id = trajs[-2].group_id = 11
    _assert_same(shared, per_sequence, trajs)


def test_eager_attention_takes_the_mask_as_additive(tiny):
    model, tok = tiny
    eager = copy.deepcopy(model)
    eager.set_attn_implementation("eager")
    shared, per_sequence = _pair((eager, tok), LoraSpec(r=4, alpha=8), AlgorithmSpec(loss_aggregation="seq-mean"), micro_batch_size=3)
    assert shared.model.get_base_model().config._attn_implementation == "eager"
    _assert_same(shared, per_sequence, single_turn(seed=10) + multi_turn(seed=11))


def test_an_update_with_the_flag_on_and_off_takes_the_same_step(tiny):
    shared, per_sequence = _pair(tiny, LoraSpec(r=4, alpha=8), AlgorithmSpec())
    trajs = single_turn(seed=9)
    bounds = update_bounds(per_sequence, trajs)  # the step's gradient bounds how far rounding moves the step
    ma, mb = shared.update(trajs), per_sequence.update(trajs)
    assert ma["update/grad_norm"] == pytest.approx(mb["update/grad_norm"], rel=PASS)  # a norm of gradients within PASS
    a, b = shared.trainable_state(), per_sequence.trainable_state()
    assert all(same_adam_step(a[k], b[k], bounds.grads[k], lr=1e-3) for k in a)
    assert ma["update/positions_computed"] < mb["update/positions_computed"]


def test_plan_packs_whole_groups_and_splits_only_large_ones():
    assert common_prefix_length([[1, 2, 3], [1, 2, 4, 5], [1, 2]]) == 2
    assert common_prefix_length([[1, 2], [1, 2]]) == 2 and common_prefix_length([[1], [2]]) == 0
    ids = [[1, 2, 3, 4], [5, 6], [1, 2, 9, 9, 9], [1, 2, 3], [5, 7, 7], [8, 8, 8]]
    packs = plan(ids, [0, 1, 0, 0, 1, 2], micro_batch_size=5)
    # groups 0 and 1 (3 + 2 records) fill a pack; group 2 starts the next
    assert [(p.groups, p.prefix_lengths, p.rows) for p in packs] == [([[0, 2, 3], [1, 4]], [2, 1], [[0, 2, 3, 1, 4]]),
                                                                   ([[5]], [3], [[5]])]
    assert packs[0].slot(4) == 1 and packs[0].slot(3) == 0
    # a group above micro_batch_size is a pack of its own, its completions in rows of at most that many
    packs = plan(ids, [0, 1, 0, 0, 1, 2], micro_batch_size=2)
    assert [(p.groups, p.rows) for p in packs] == [([[0, 2, 3]], [[0, 2], [3]]), ([[1, 4]], [[1, 4]]), ([[5]], [[5]])]
    # and a pack holds at most pack_tokens tokens (its prefixes once, completions); a large group's rows as many completion tokens
    assert [p.rows for p in plan(ids, [0, 1, 0, 0, 1, 2], micro_batch_size=8, pack_tokens=4)] == [[[0], [2, 3]], [[1, 4]], [[5]]]


def test_auto_shares_prefixes_on_the_cpu_and_scores_records_whole_on_a_gpu(tiny):
    """`shared_prefix: auto` (the default): on the CPU the saving wins; on a GPU whole records in
    large micro-batches ran 1.8x faster (bench/results/gpu_variants_full.md). An explicit true or
    false is kept on either device."""
    from opentinker.backend.device import Placement

    model, tok = tiny
    assert OptimizationSpec().shared_prefix == "auto"
    gpu = Placement(torch.device("cuda", 0), torch.bfloat16)  # only its device type is read
    for flag, on_cpu, on_gpu in (("auto", True, False), (True, True, True), (False, False, False)):
        trainer = PolicyTrainer(copy.deepcopy(model), tok, LoraSpec(r=4, alpha=8), AlgorithmSpec(), OptimizationSpec(shared_prefix=flag))
        assert trainer.shares_prefixes() is on_cpu
        trainer.placement = gpu
        assert trainer.shares_prefixes() is on_gpu
    with pytest.raises(ValueError, match="shared_prefix"):
        OptimizationSpec(shared_prefix="sometimes")


@pytest.mark.parametrize("adapter", [LoraSpec(r=4, alpha=8), FullSpec()], ids=["lora", "full"])
def test_a_compiled_trainer_takes_the_eager_step(tiny, adapter):
    """optimization.compile: each decoder layer's MLP and norms run compiled (inductor), the
    update's loss, gradient norm and new weights those of the eager trainer."""
    model, tok = tiny
    trainers = [PolicyTrainer(copy.deepcopy(model), tok, adapter, AlgorithmSpec(), OptimizationSpec(lr=1e-3, compile=c))
                for c in (False, True)]
    gen = torch.Generator().manual_seed(0)  # the same weights for both (peft draws a fresh adapter per model), B non-zero
    state = {k: torch.randn(v.shape, generator=gen) * 0.05 if "lora" in k else v for k, v in trainers[0].trainable_state().items()}
    for t in trainers:
        t.load_trainable_state(state)
    layers = model.config.num_hidden_layers
    assert sum(hasattr(m, "_compiled_call_impl") and m._compiled_call_impl is not None for m in trainers[1].model.modules()) == 3 * layers
    trajs = single_turn(seed=9)
    bounds = update_bounds(trainers[0], trajs)
    # inductor's fused kernels against eager ones: the same sums in other orders (tests/rounding.py)
    (ma, mb) = (t.update(trajs) for t in trainers)
    assert same_update_metrics(mb, ma, bounds)
    assert mb["update/grad_norm"] == pytest.approx(ma["update/grad_norm"], rel=PASS)
    a, b = (t.trainable_state() for t in trainers)
    assert all(same_adam_step(b[k], a[k], bounds.grads[k], lr=1e-3) for k in a)
    assert not all(torch.equal(a[k], state[k]) for k in a)  # the step moved the weights
