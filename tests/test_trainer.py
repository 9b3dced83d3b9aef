"""The trainer: version handshake, gradient accumulation, LoRA vs full, KL to the reference."""

import pytest
import torch

from opentinker.agent import ChatFormat, EpisodeLimits, run_episodes
from opentinker.backend import HFRolloutEngine, PolicyTrainer, SamplingParams, StalePolicyError
from opentinker.core.spec import AlgorithmSpec, FullSpec, KLSpec, LoraSpec, OptimizationSpec
from envs.toy import UppercaseGame


def _batch(trainer, tok, n_groups=2, group=4, seed=0):
    torch.manual_seed(seed)
    engine = HFRolloutEngine(trainer.model, tok)
    engine.policy_version = trainer.version
    games = [UppercaseGame() for _ in range(n_groups * group)]
    tasks = [{"prompt": f"Say something about item {i // group}."} for i in range(n_groups * group)]
    groups = [i // group for i in range(n_groups * group)]
    return run_episodes(engine, ChatFormat(tok), games, tasks, SamplingParams(max_new_tokens=4), EpisodeLimits(), groups)


def _with_signal(trajs):
    # force a reward spread inside each group so that advantages are non-zero
    for i, t in enumerate(trajs):
        t.turns[-1].reward = float(i % 2)
    return trajs


def test_stale_rollouts_are_refused_unless_allowed(tiny):
    model, tok = tiny
    trainer = PolicyTrainer(model, tok, LoraSpec(r=4), AlgorithmSpec(), OptimizationSpec(lr=1e-3))
    trajs = _with_signal(_batch(trainer, tok))
    trainer.update(trajs)  # version 0 -> 1
    with pytest.raises(StalePolicyError, match="version 0, trainer is at 1"):
        trainer.update(trajs)
    trainer.algorithm = AlgorithmSpec(max_staleness=1)
    trainer.update(trajs)
    assert trainer.version == 2


@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean"])
def test_gradient_accumulation_matches_one_big_batch(tiny_path, aggregation):
    from opentinker.core.model_names import TINY
    from opentinker.model.policy import load_model

    results = []
    for mb in (8, 3):
        model, tok = load_model(TINY)
        torch.manual_seed(1)
        trainer = PolicyTrainer(model, tok, LoraSpec(r=4), AlgorithmSpec(loss_aggregation=aggregation),
                                OptimizationSpec(lr=1e-2, micro_batch_size=mb))
        trajs = _with_signal(_batch(trainer, tok, seed=5))
        metrics = trainer.update(trajs)
        results.append((trainer.trainable_state(), metrics))
    (a, ma), (b, mb_) = results
    assert ma["update/policy_loss"] == pytest.approx(mb_["update/policy_loss"], abs=1e-6)
    assert ma["update/grad_norm"] == pytest.approx(mb_["update/grad_norm"], rel=1e-5)
    assert all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)


def test_lora_trains_only_the_adapter_and_full_trains_everything(tiny_path):
    from opentinker.core.model_names import TINY
    from opentinker.model.policy import load_model

    model, tok = load_model(TINY)
    lora = PolicyTrainer(model, tok, LoraSpec(r=4), AlgorithmSpec(), OptimizationSpec(lr=1e-2))
    assert lora.trainable_state() and all("lora_" in k for k in lora.trainable_state())
    before = {k: v.clone() for k, v in lora.model.named_parameters()}
    lora.update(_with_signal(_batch(lora, tok)))
    changed = {k for k, v in lora.model.named_parameters() if not torch.equal(v, before[k])}
    assert changed and all("lora_" in k for k in changed)

    model, tok = load_model(TINY)
    full = PolicyTrainer(model, tok, FullSpec(), AlgorithmSpec(), OptimizationSpec(lr=1e-3))
    n_params = sum(1 for _ in full.model.parameters())
    assert len(full.trainable_state()) == n_params
    before = {k: v.clone() for k, v in full.model.named_parameters()}
    full.update(_with_signal(_batch(full, tok)))
    assert all(not torch.equal(v, before[k]) for k, v in full.model.named_parameters())


def test_lora_reference_is_the_base_without_a_second_copy(tiny_path):
    from opentinker.core.model_names import TINY
    from opentinker.model.policy import load_model

    model, tok = load_model(TINY)
    algo = AlgorithmSpec(kl=KLSpec(coef=0.5, estimator="k3"))
    trainer = PolicyTrainer(model, tok, LoraSpec(r=4), algo, OptimizationSpec(lr=5e-2))
    assert trainer.reference is None
    first = trainer.update(_with_signal(_batch(trainer, tok)))
    assert first["update/kl"] == pytest.approx(0.0, abs=1e-7)  # LoRA B starts at zero: policy == base
    second = trainer.update(_with_signal(_batch(trainer, tok, seed=1)))
    assert second["update/kl"] > 1e-6

    model, tok = load_model(TINY)
    full = PolicyTrainer(model, tok, FullSpec(), algo, OptimizationSpec(lr=1e-3))
    assert full.reference is not None and not any(p.requires_grad for p in full.reference.parameters())


def test_failed_episodes_are_left_out_of_the_update(tiny):
    model, tok = tiny
    trainer = PolicyTrainer(model, tok, LoraSpec(r=4), AlgorithmSpec(), OptimizationSpec(lr=1e-3))
    trajs = _with_signal(_batch(trainer, tok))
    trajs[0].failed = True
    metrics = trainer.update(trajs)
    assert metrics["update/sequences"] == len(trajs) - 1


def test_a_step_whose_episodes_all_failed_is_skipped_not_refused_as_stale(tiny):
    """Episodes that failed before sampling (an environment server down) carry no policy version
    worth checking: the update is skipped and the version still advances with the trainer."""
    model, tok = tiny
    trainer = PolicyTrainer(model, tok, LoraSpec(r=4), AlgorithmSpec(), OptimizationSpec(lr=1e-3))
    trainer.version = 3
    trajs = _with_signal(_batch(trainer, tok))
    for t in trajs:
        t.failed, t.policy_version = True, 0
    metrics = trainer.update(trajs)
    assert metrics["update/sequences"] == 0 and metrics["update/skipped"] == 1.0
    assert trainer.version == 4
    fresh = _with_signal(_batch(trainer, tok))
    for t in fresh:
        t.policy_version = 2  # a real stale sample is still refused
    with pytest.raises(StalePolicyError):
        trainer.update(fresh)
