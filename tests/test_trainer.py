"""The trainer: version handshake, gradient accumulation, LoRA vs full, KL to the reference."""

import pytest
import torch

from opentinker.agent import ChatFormat, EpisodeLimits, run_episodes
from opentinker.backend import HFRolloutEngine, PolicyTrainer, SamplingParams, StalePolicyError
from opentinker.core.spec import AlgorithmSpec, FullSpec, KLSpec, LoraSpec, OptimizationSpec
from envs.toy import UppercaseGame
from tests.rounding import PASS, logprob_gap, same_adam_step, same_grad, same_metric, same_update_metrics, update_bounds


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


@pytest.mark.parametrize("behaviour", ["older versions", "another engine in bfloat16"])
def test_the_off_policy_update_takes_the_proximal_logprobs_from_its_own_pass(tiny, behaviour):
    """Decoupled PPO's proximal policy is the policy before the update's one optimizer step, the
    weights every pass of the update runs on: the trainer's loss and gradient equal those computed
    by the definition (pi_prox from a forward without gradient before the update, by hand here).
    The same loss corrects tokens drawn by older versions (k > 0) and tokens drawn by the same
    weights in a lower precision (a bfloat16 vLLM under a float32 trainer, at k = 0)."""
    from opentinker.algo import compute_advantages

    model, tok = tiny
    algorithm = AlgorithmSpec(max_staleness=2 if behaviour == "older versions" else 0, importance_cap=2.0, clip_range=0.2)
    trainer = PolicyTrainer(model, tok, LoraSpec(r=4), algorithm, OptimizationSpec(lr=1e-3), sampled_apart=behaviour == "another engine in bfloat16")
    assert trainer.off_policy
    trajs = _with_signal(_batch(trainer, tok, seed=3))
    for t in trajs:  # drawn by an older policy: behaviour logprobs away from the current ones, some past the cap
        t.sampling_logprobs = [lp + (0.9 * (i % 3) - 0.9) * m for i, (lp, m) in enumerate(zip(t.sampling_logprobs, t.loss_mask))]
    metrics = trainer.compute_gradients(trajs)
    got = {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert metrics["update/ratio_mean"] == pytest.approx(1.0, abs=1e-6) and metrics["update/clip_fraction"] == 0.0

    prox = trainer.logprobs(trajs)  # the definition: one forward without gradient, before the update
    trainer.model.zero_grad(set_to_none=True)
    trainer.model.train()
    rewards = torch.tensor([t.reward for t in trajs])
    adv = compute_advantages("grpo", rewards, torch.tensor([t.group_id for t in trajs]))
    total, tokens, sensitivity, lps, sampler_gap = torch.zeros(()), 0, 0.0, [], 0.0
    for t, a, p in zip(trajs, adv, prox):
        ids = torch.tensor([t.token_ids])
        logits = trainer.model(input_ids=ids).logits[0, :-1].float() / trainer.temperature
        at = torch.tensor([i for i, m in enumerate(t.loss_mask[1:]) if m])
        lp = torch.log_softmax(logits[at], dim=-1).gather(-1, ids[0, 1:][at][:, None]).squeeze(-1)
        p = torch.tensor(p)
        behaviour = torch.tensor([t.sampling_logprobs[i + 1] for i in at.tolist()])
        ratio, w = torch.exp(lp - p), torch.exp(p - behaviour).clamp(max=2.0)
        total = total - (w * torch.minimum(ratio * a, ratio.clamp(0.8, 1.2) * a)).sum()
        tokens += len(at)
        sensitivity += 3 * float((w * ratio * a.abs()).sum())  # through lp, and p in the ratio and the weight
        lps += lp.tolist()
        sampler_gap += float((p - behaviour).abs().sum())
    (total / tokens).backward()
    # one packed pass against a pass per record: the same sums in other orders (tests/rounding.py);
    # lp and p err by up to lp_gap each, so the loss by its sensitivity times that, and the gradient,
    # scaled by w·ratio, by PASS and 3·lp_gap of itself
    lp_gap = logprob_gap(lps)
    assert same_metric(metrics["update/policy_loss"], float(total.detach() / tokens), sensitivity / tokens, lp_gap)
    assert 0 < metrics["update/behaviour_weight_capped"] < 1  # the cap was reached by some tokens, not all
    assert abs(metrics["update/sampler_logprob_gap"] - sampler_gap / tokens) <= lp_gap  # mean |pi_prox - pi_behaviour|, p off by lp_gap
    for name, grad in got.items():
        want = dict(trainer.model.named_parameters())[name].grad
        assert same_grad(grad, want, rel=PASS + 3 * lp_gap), name


@pytest.mark.parametrize("engine, model_dtype, sampler_dtype, corrects", [
    ("vllm", "float32", "float32", False),  # vLLM's float32 logprobs are the trainer's within 1e-4 (tested with vLLM)
    ("vllm", "float32", "bfloat16", True),
    ("vllm", "bfloat16", "bfloat16", True),  # the same precision, another program's kernels and merged, rounded weights
    ("vllm", "bfloat16", "float32", True),
    ("local", "bfloat16", "auto", False),  # the trainer's own model samples, under the same autocast
])
def test_a_policy_corrects_for_another_engines_reduced_precision(tmp_path, engine, model_dtype, sampler_dtype, corrects):
    from opentinker.rl import Policy
    from tests.conftest import tiny_spec

    spec = tiny_spec(tmp_path, model={"name": "tiny-random", "dtype": model_dtype},
                     rollout={"engine": engine, "sampler_dtype": sampler_dtype})
    assert Policy(spec).trainer.off_policy is corrects


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
        bounds = update_bounds(trainer, trajs)  # the step's gradient bounds how far rounding moves the step
        metrics = trainer.update(trajs)
        results.append((trainer.trainable_state(), metrics))
    (a, ma), (b, mb_) = results
    # micro-batches of 8 or 3: the same sums in other orders (tests/rounding.py)
    assert same_update_metrics(ma, mb_, bounds)
    assert ma["update/grad_norm"] == pytest.approx(mb_["update/grad_norm"], rel=PASS)
    assert all(same_adam_step(a[k], b[k], bounds.grads[k], lr=1e-2) for k in a)


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
    assert first["update/kl"] == pytest.approx(0.0, abs=1e-7)  # LoRA B starts at zero: policy == base, adding an exact 0
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
