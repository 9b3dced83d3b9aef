"""The Tinker token losses (sums, against hand-computed values) and the primitive trainer
(logprobs, gradient accumulation, exact AdamW, input checks, seeds, checkpoint round trip)."""

import io
import math

import numpy as np
import pytest
import torch

from opentinker.algo.primitive_losses import LOSSES, UnsupportedLoss, loss_config, primitive_loss
from tests.rounding import EPS32, logprob_gap, order_gap, same_grad, same_logprobs, same_metric

# Two datums over T=3 positions; datum 1's last position is padding (mask 0, odd values).
LP = [[-1.0, -0.5, -2.0], [-0.3, -1.2, -0.7]]
Q = [[-1.3, -0.4, -1.6], [-0.5, -0.9, 5.0]]  # lp - q = [[.3, -.1, -.4], [.2, -.3, -5.7]]
A = [[1.0, -2.0, 0.5], [0.7, -3.0, 9.0]]
A_GSPO = [[1.0, 0.0, 0.5], [0.0, -2.0, 9.0]]  # zeros: tokens left out of the sequence ratio
W = [[1.0, 0.5, -2.0], [2.0, 1.0, 7.0]]
M = [[1, 1, 1], [1, 1, 0]]


def run(name, rows=(0, 1), config=None, lp=LP, q=Q, adv=None):
    """primitive_loss on the datums `rows` of the fixture; (loss, d loss/d lp, metrics)."""
    adv = adv or (A_GSPO if name == "gspo" else A)
    pick = lambda table: torch.tensor([table[r] for r in rows], dtype=torch.float32)  # noqa: E731
    lp_t = pick(lp).requires_grad_(True)
    inputs = {"weights": pick(W), "logprobs": pick(q), "advantages": pick(adv)}
    out = primitive_loss(name, lp_t, inputs, pick(M), loss_config(name, config or {}))
    out.loss.backward()
    return out.loss.item(), lp_t.grad.tolist(), out.metrics


def by_hand(name, lo=None, hi=None, beta=0.05):
    """The loss and its gradient per position, from the docstring's formulas in plain Python."""
    loss, grad = 0.0, [[0.0] * 3 for _ in range(2)]
    for b in range(2):
        if name == "gspo":
            toks = [t for t in range(3) if M[b][t] and A_GSPO[b][t] != 0]
            s = math.exp(sum(LP[b][t] - Q[b][t] for t in toks) / len(toks))
            for t in toks:
                a = A_GSPO[b][t]
                loss -= min(s * a, min(max(s, lo), hi) * a)
                if s * a <= min(max(s, lo), hi) * a:  # unclipped: d s / d lp_u = s / len(toks)
                    for u in toks:
                        grad[b][u] -= a * s / len(toks)
            continue
        for t in range(3):
            if not M[b][t]:
                continue
            lp, q, a, w = LP[b][t], Q[b][t], A[b][t], W[b][t]
            r = math.exp(lp - q)
            c = min(max(r, lo), hi) if lo is not None else r
            value, g = {
                "cross_entropy": (-w * lp, -w),
                "importance_sampling": (-r * a, -r * a),
                "ppo": (-min(r * a, c * a), -r * a if r * a <= c * a else 0.0),
                "cispo": (-c * lp * a, -c * a),
                "dro": (-(lp * a - 0.5 * beta * (lp - q) ** 2), -(a - beta * (lp - q))),
            }[name]
            loss += value
            grad[b][t] = g
    return loss, grad


CASES = [
    ("cross_entropy", {}, {}),
    ("importance_sampling", {}, {}),
    ("ppo", {}, {"lo": 0.8, "hi": 1.2}),
    ("cispo", {}, {"lo": 0.8, "hi": 1.2}),
    ("dro", {}, {}),
    ("dro", {"beta": 0.5}, {"beta": 0.5}),
    ("gspo", {}, {"lo": 1 - 3e-4, "hi": 1 + 4e-4}),
    ("gspo", {"clip_low_threshold": 0.5, "clip_high_threshold": 2.0}, {"lo": 0.5, "hi": 2.0}),
]


@pytest.mark.parametrize("name,config,hand", CASES)
def test_loss_value_and_gradient_match_hand_computation(name, config, hand):
    """Each loss and its d/d lp equal the docstring's formula computed by hand; padding gets no gradient."""
    loss, grad, metrics = run(name, config=config)
    want_loss, want_grad = by_hand(name, **hand)
    # float32 against float64 by hand: ≤ 12 roundings (eps/2 each) of terms of total size ≤ 10 stay below 7e-6
    assert loss == pytest.approx(want_loss, abs=1e-5)
    assert np.allclose(grad, want_grad, atol=1e-5), (grad, want_grad)
    assert grad[1][2] == 0.0
    assert metrics["loss:sum"] == pytest.approx(loss) and all(k.count(":") == 1 for k in metrics)


def test_spot_values():
    """Literal anchors: cross entropy is -Σw·lp = -0.95; PPO's clip binds at three positions, CISPO's never stops gradient."""
    assert run("cross_entropy")[0] == pytest.approx(-0.95)
    assert run("cross_entropy")[1] == [[-1.0, -0.5, 2.0], [-2.0, -1.0, 0.0]]
    ppo_grad = run("ppo")[1]
    assert ppo_grad[0][0] == ppo_grad[1][0] == ppo_grad[1][1] == 0.0  # r·A above the clipped term
    assert ppo_grad[0][1] == pytest.approx(2 * math.exp(-0.1)) and ppo_grad[0][2] == pytest.approx(-0.5 * math.exp(-0.4))
    assert run("cispo")[1][0][0] == pytest.approx(-1.2)  # -clip(r)·A, r = e^0.3 clipped to 1.2
    s0 = math.exp(-0.05)  # gspo datum 0: mean of (lp - q) over positions 0 and 2 only
    gspo_grad = run("gspo", config={"clip_low_threshold": 0.5, "clip_high_threshold": 2.0})[1]
    assert gspo_grad[0] == pytest.approx([-0.75 * s0, 0.0, -0.75 * s0])


def test_gspo_takes_the_sequence_ratio_over_its_mask():
    """With a sequence_ratio_mask that differs from the advantages' support (the cookbook's gspo sends
    one), the ratio is the mask's: datum 0 has mask [1, 1, 0] and advantages [1, 0, 0.5], so
    s = exp((0.3 - 0.1) / 2), loss = -(1 + 0.5)·s (unclipped), and position 1 (advantage 0) gets a
    gradient through s while position 2 (outside the mask) gets none."""
    lp = torch.tensor([LP[0]], requires_grad=True)
    inputs = {"logprobs": torch.tensor([Q[0]]), "advantages": torch.tensor([A_GSPO[0]]),
              "sequence_ratio_mask": torch.tensor([[1.0, 1.0, 0.0]])}
    out = primitive_loss("gspo", lp, inputs, torch.tensor([M[0]]), loss_config("gspo", {"clip_low_threshold": 0.5, "clip_high_threshold": 2.0}))
    out.loss.backward()
    s = math.exp(0.1)
    assert out.loss.item() == pytest.approx(-1.5 * s, abs=1e-6)
    assert lp.grad[0].tolist() == pytest.approx([-0.75 * s, -0.75 * s, 0.0], abs=1e-6)
    # without the mask: the advantages' support (positions 0 and 2), as test_spot_values has it
    del inputs["sequence_ratio_mask"]
    lp.grad = None
    primitive_loss("gspo", lp, inputs, torch.tensor([M[0]]), loss_config("gspo", {"clip_low_threshold": 0.5, "clip_high_threshold": 2.0})).loss.backward()
    assert lp.grad[0].tolist() == pytest.approx([-0.75 * math.exp(-0.05), 0.0, -0.75 * math.exp(-0.05)], abs=1e-6)


def test_cross_entropy_with_soft_targets_by_hand():
    """Soft targets ([B, T, K] logprobs and weights): loss = -Σ_t Σ_k w·lp over real positions, d/d lp = -w."""
    lp = torch.tensor([[[-1.0, -2.0], [-0.5, -3.0], [-4.0, -4.0]]], requires_grad=True)
    w = torch.tensor([[[0.75, 0.25], [1.0, 0.0], [0.5, 0.5]]])
    out = primitive_loss("cross_entropy", lp, {"weights": w}, torch.tensor([[1, 1, 0]]), {})
    out.loss.backward()
    assert out.loss.item() == pytest.approx(0.75 * 1 + 0.25 * 2 + 0.5)  # the padded position counts nothing
    assert lp.grad.tolist() == [[[-0.75, -0.25], [-1.0, 0.0], [0.0, 0.0]]]


@pytest.mark.parametrize("name", list(LOSSES))
def test_losses_are_sums_and_ignore_padding(name):
    """A batch's loss is the sum of its datums' (a repeated datum counts twice); padded values change nothing."""
    one, two = run(name, rows=(0,))[0], run(name, rows=(1,))[0]
    assert run(name)[0] == pytest.approx(one + two, abs=1e-5)
    assert run(name, rows=(0, 0))[0] == pytest.approx(2 * one, abs=1e-5)
    odd = lambda t: [t[0], t[1][:2] + [-3.0]]  # noqa: E731
    loss, grad, _ = run(name, lp=odd(LP), q=odd(Q), adv=odd(A_GSPO if name == "gspo" else A))
    assert loss == pytest.approx(run(name)[0], abs=1e-5) and grad[1][2] == 0.0


def test_loss_config():
    """Defaults, overrides, and refusals (unknown loss naming the supported ones, unknown key, non-finite value)."""
    assert loss_config("ppo", {}) == {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}
    assert loss_config("dro", {}) == {"beta": 0.05} and loss_config("cross_entropy", {}) == {}
    assert loss_config("gspo", {}) == {"clip_low_threshold": 1 - 3e-4, "clip_high_threshold": 1 + 4e-4}
    assert loss_config("cispo", {"clip_high_threshold": 2}) == {"clip_low_threshold": 0.8, "clip_high_threshold": 2.0}
    with pytest.raises(UnsupportedLoss) as err:
        loss_config("stable_reinforce", {})
    assert all(name in str(err.value) for name in LOSSES)
    with pytest.raises(UnsupportedLoss, match="unknown key.*clip_ratio"):
        loss_config("ppo", {"clip_ratio": 0.2})
    with pytest.raises(UnsupportedLoss, match="allowed: none"):
        loss_config("cross_entropy", {"beta": 1.0})
    for bad in (math.nan, math.inf):
        with pytest.raises(UnsupportedLoss, match="finite"):
            loss_config("dro", {"beta": bad})


# -- the primitive trainer on the tiny random model ------------------------------------------------
from opentinker.backend.primitives import AdamParams, BadRequest, LoraShape, PrimitiveModel  # noqa: E402
from opentinker.model import load_model  # noqa: E402
from opentinker.tinker.wire import TokenDatum  # noqa: E402


def make(seed=0):
    base, tok = load_model("tiny-random")
    return PrimitiveModel(base, tok, "tiny-random", LoraShape(rank=4, seed=seed))


def datum(tokens, **inputs):
    targets = np.array(tokens[1:] + [2], np.int64)
    return TokenDatum(tokens=tokens, inputs={"target_tokens": targets, **{k: np.array(v, np.float32) for k, v in inputs.items()}})


DATA = [datum([1, 50, 300, 7, 9], weights=[1, 1, 0.5, 1, 0]), datum([4, 800, 12], weights=[1, -1, 2]),
        datum([30, 31, 32, 33], weights=[0.5, 0.5, 0.5, 0.5])]
ADAM = AdamParams(learning_rate=1e-2, beta1=0.8, beta2=0.9, eps=1e-6, weight_decay=0.1, grad_clip_norm=0)


def grads(pm):
    return [None if p.grad is None else p.grad.clone() for p in pm.params]


def close(a, b, atol=1e-6):
    return a.keys() == b.keys() and all(torch.allclose(a[k], b[k], atol=atol, rtol=0) for k in a)


def test_forward_backward_logprobs_and_cross_entropy():
    """Per-datum logprobs equal log_softmax(logits)[target] computed apart; loss:sum = -Σ w·lp."""
    pm = make()
    outputs, metrics = pm.forward_backward(DATA, "cross_entropy", {})
    want = 0.0
    for d, out in zip(DATA, outputs):
        with torch.no_grad():
            logits = pm.model(input_ids=torch.tensor([d.tokens])).logits[0]
        lp = torch.log_softmax(logits.float(), -1).gather(-1, torch.as_tensor(d.inputs["target_tokens"])[:, None])[:, 0]
        assert out["logprobs"].shape == (len(d.tokens),)
        assert same_logprobs(out["logprobs"], lp)  # a padded batch against one row: tests/rounding.py
        want -= float((torch.as_tensor(d.inputs["weights"]) * lp).sum())
    all_lps = np.concatenate([out["logprobs"] for out in outputs])
    assert same_metric(metrics["loss:sum"], want, sum(float(np.abs(d.inputs["weights"]).sum()) for d in DATA), logprob_gap(all_lps))
    assert all(k.count(":") == 1 for k in metrics)
    assert all(k.count(":") == 1 for k in pm.optim_step(ADAM))


def test_soft_targets_score_each_candidate_and_train_like_their_weighted_hard_targets():
    """[N, K] target_tokens and weights (off-policy distillation's teacher top-K): the logprobs come
    back [N, K], each log_softmax(logits)[target] computed apart; the loss is -Σ w·lp; and the
    gradient equals that of K hard-target datums weighted alike (what the soft form means)."""
    tokens = [1, 50, 300, 7]
    targets = np.array([[50, 51, 52], [300, 2, 9], [7, 7, 7], [9, 10, 11]], np.int64)
    weights = np.array([[0.6, 0.3, 0.1], [1.0, 0.0, 0.0], [0.2, 0.2, 0.6], [0.0, 0.0, 0.0]], np.float32)
    soft = TokenDatum(tokens, {"target_tokens": targets, "weights": weights})
    pm = make(seed=5)
    (out,), metrics = pm.forward_backward([soft], "cross_entropy", {})
    with torch.no_grad():
        logp = torch.log_softmax(pm.model(input_ids=torch.tensor([tokens])).logits[0].float(), -1)
    want = logp.gather(-1, torch.as_tensor(targets))
    assert out["logprobs"].shape == (4, 3) and same_logprobs(out["logprobs"], want)
    assert same_metric(metrics["loss:sum"], -float((torch.as_tensor(weights) * want).sum()), float(weights.sum()), logprob_gap(want))
    hard = make(seed=5)
    hard.forward_backward([TokenDatum(tokens, {"target_tokens": targets[:, k].copy(), "weights": weights[:, k].copy()}) for k in range(3)],
                          "cross_entropy", {})
    # float32 sums in another order (one row against three): tests/rounding.py
    assert all(same_grad(a, b) for a, b in zip(grads(pm), grads(hard)) if a is not None)
    # one call with hard and soft datums side by side: each comes back in its own shape, same values
    both, _ = make(seed=5).forward_backward([soft, DATA[1]], "cross_entropy", {}, forward_only=True)
    alone, _ = make(seed=5).forward_backward([DATA[1]], "cross_entropy", {}, forward_only=True)
    assert both[0]["logprobs"].shape == (4, 3) and same_logprobs(both[0]["logprobs"], out["logprobs"])
    assert both[1]["logprobs"].shape == (3,) and same_logprobs(both[1]["logprobs"], alone[0]["logprobs"])


def test_the_head_in_chunks_computes_what_it_computes_at_once(monkeypatch):
    """Logits a few positions at a time, recomputed in the backward (HEAD_CHUNK_POSITIONS: the
    pass's memory bound), give the logprobs, loss and gradients of the head over all positions at once."""
    import opentinker.backend.primitives as primitives

    results = []
    for chunk in (0, 3):  # 0: every position at once
        monkeypatch.setattr(primitives, "HEAD_CHUNK_POSITIONS", chunk)
        pm = make(seed=4)
        outputs, metrics = pm.forward_backward(DATA, "cross_entropy", {})
        results.append((outputs, metrics, grads(pm)))
    (whole, m_whole, g_whole), (chunked, m_chunked, g_chunked) = results
    # float32 sums in another order: tests/rounding.py
    assert all(same_logprobs(a["logprobs"], b["logprobs"]) for a, b in zip(whole, chunked))
    lp_gap = logprob_gap(np.concatenate([out["logprobs"] for out in whole]))
    assert same_metric(m_chunked["loss:sum"], m_whole["loss:sum"], sum(float(np.abs(d.inputs["weights"]).sum()) for d in DATA), lp_gap)
    assert all(same_grad(b, a) for a, b in zip(g_whole, g_chunked) if a is not None)


def test_forward_only_leaves_gradients_alone():
    """forward_only computes the same logprobs but adds no gradient (none before, the same after a backward)."""
    pm = make()
    out_only, _ = pm.forward_backward(DATA, "cross_entropy", {}, forward_only=True)
    assert all(g is None for g in grads(pm))
    out, _ = pm.forward_backward(DATA, "cross_entropy", {})
    before = grads(pm)
    pm.forward_backward(DATA, "cross_entropy", {}, forward_only=True)
    assert all(torch.equal(a, b) for a, b in zip(before, grads(pm)) if a is not None)  # nothing added: exact
    # without autograd the linears may run other kernels (packed_linear): another order, tests/rounding.py
    assert all(same_logprobs(a["logprobs"], b["logprobs"]) for a, b in zip(out_only, out))


def test_gradients_accumulate_across_calls():
    """Two forward_backward calls on halves then a step equal one call on the whole batch then a step."""
    split, whole = make(seed=3), make(seed=3)
    split.forward_backward(DATA[:1], "cross_entropy", {})
    split.forward_backward(DATA[1:], "cross_entropy", {})
    whole.forward_backward(DATA, "cross_entropy", {})
    # float32 sums in another order (the unembedding runs over other row sets): tests/rounding.py
    assert all(same_grad(a, b) for a, b in zip(grads(split), grads(whole)) if a is not None)
    # (not the weights after an Adam step: where a gradient is ~0, float noise decides the sign of a ±lr update)
    assert split.optim_step(ADAM)["tokens:sum"] == whole.optim_step(ADAM)["tokens:sum"] == 12.0


def test_optim_step_is_adamw_with_the_given_params():
    """Two steps equal torch AdamW (same lr, betas, eps, decoupled weight decay) on copies of the params and grads."""
    pm = make()
    ref = [p.detach().clone().requires_grad_(True) for p in pm.params]
    opt = torch.optim.AdamW(ref, lr=1e-2, betas=(0.8, 0.9), eps=1e-6, weight_decay=0.1)
    for _ in range(2):  # the second step is where the betas show
        pm.forward_backward(DATA, "cross_entropy", {})
        for r, g in zip(ref, grads(pm)):
            r.grad = g
        pm.optim_step(ADAM)
        opt.step()
    assert all(torch.equal(p, r) for p, r in zip(pm.params, ref))  # torch's AdamW itself on the same gradients: exact
    assert pm.steps == 2 and all(p.grad is None for p in pm.params)


def test_grad_clip_norm_clips_and_reports_the_norm_before():
    """grad_clip_norm > 0 scales the gradient to that norm; grad_norm:mean is the norm before clipping."""
    pm = make()
    pm.forward_backward(DATA, "cross_entropy", {})
    g = grads(pm)
    norm = float(torch.sqrt(sum((x.double() ** 2).sum() for x in g if x is not None)))
    adam = AdamParams(learning_rate=1e-2, eps=1.0, grad_clip_norm=norm / 10)  # eps 1: the step is ~linear in g
    ref = [p.detach().clone().requires_grad_(True) for p in pm.params]
    opt = torch.optim.AdamW(ref, lr=1e-2, betas=(adam.beta1, adam.beta2), eps=1.0, weight_decay=0.0)
    for r, x in zip(ref, g):
        r.grad = None if x is None else x * (norm / 10) / (norm + 1e-6)
    # the step's norm is a float32 sum of n squares against this float64 one: within order_gap(n)
    # (tests/rounding.py), and so is its clipping factor; with eps 1 a step moves by at most
    # lr·|g|·that (d/dg of lr·g/(|g| + 1) is at most lr), plus a few roundings of the weight
    n = sum(x.numel() for x in g if x is not None)
    assert pm.optim_step(adam)["grad_norm:mean"] == pytest.approx(norm, rel=order_gap(n))
    opt.step()
    clipped = max(float(r.grad.abs().max()) for r in ref if r.grad is not None)
    step_gap = adam.learning_rate * clipped * order_gap(n) + 4 * EPS32 * (max(float(r.abs().max()) for r in ref) + adam.learning_rate)
    assert all(torch.allclose(p, r, atol=step_gap, rtol=0) for p, r in zip(pm.params, ref))


@pytest.mark.parametrize("data,loss_fn,match", [
    ([TokenDatum([1, 49152], {"target_tokens": np.array([2, 3])})], "cross_entropy", r"data\[0\]\.model_input: token ids must be in \[0, 49152\)"),
    ([datum([1, 2, 3]), TokenDatum([1, 2], {"target_tokens": np.array([2])})], "cross_entropy", r"data\[1\].*target_tokens.*shape \[1\].*2 tokens"),
    ([datum([1, 2], logprobs=[0, 0], advantages=[1, math.nan])], "importance_sampling", r"data\[0\].*'advantages'.*NaN"),
    ([datum([1, 2], logprobs=[0, 0])], "ppo", r"data\[0\]\.loss_fn_inputs: ppo needs advantages"),
    ([], "cross_entropy", r"data: empty"),
    ([TokenDatum([1, 2], {"target_tokens": np.array([[2, 3], [4, 5]]), "logprobs": np.zeros(2, np.float32),
                          "advantages": np.ones(2, np.float32)})], "ppo", r"soft targets \[N, K\] are taken by cross_entropy only, not ppo"),
    ([TokenDatum([1, 2], {"target_tokens": np.array([[2, 3], [4, 5]]), "weights": np.ones(2, np.float32)})], "cross_entropy",
     r"data\[0\]\.loss_fn_inputs\['weights'\]: shape \[2\], expected \[2, 2\]"),
])
def test_bad_input_is_a_bad_request(data, loss_fn, match):
    """Out-of-vocabulary ids, mismatched targets, NaN advantages, missing inputs and empty data name what is wrong."""
    pm = make()
    with pytest.raises(BadRequest, match=match):
        pm.forward_backward(data, loss_fn, {})
    assert all(g is None for g in grads(pm))


def test_lora_seed_makes_the_adapter_reproducible():
    """The same LoRA seed gives the same initial adapter; another seed gives other lora_A matrices."""
    a, b, c = make(seed=7).trainable_state(), make(seed=7).trainable_state(), make(seed=8).trainable_state()
    assert close(a, b, atol=0)
    lora_a = [k for k in a if "lora_A" in k]
    assert lora_a and all(not torch.equal(a[k], c[k]) for k in lora_a)


def test_state_round_trip_with_and_without_optimizer():
    """A checkpoint with the optimizer continues exactly like the original; without it the next step differs."""
    from safetensors.torch import load as load_safetensors

    pm = make(seed=1)
    pm.forward_backward(DATA, "cross_entropy", {})
    pm.optim_step(ADAM)
    files = pm.state_files(with_optimizer=True)
    weights = load_safetensors(files["weights.safetensors"])
    optimizer = torch.load(io.BytesIO(files["optimizer.pt"]), weights_only=True)
    assert "optimizer.pt" not in pm.state_files(with_optimizer=False)
    restored, fresh = make(seed=2), make(seed=2)
    restored.load_state(weights, optimizer, pm.steps)
    fresh.load_state(weights, None, pm.steps)
    assert restored.steps == fresh.steps == 1 and close(restored.trainable_state(), pm.trainable_state(), atol=0)
    for model in (pm, restored, fresh):
        model.forward_backward(DATA, "cross_entropy", {})
        model.optim_step(ADAM)
    assert close(restored.trainable_state(), pm.trainable_state(), atol=0)  # the same state, data and kernels: bit for bit
    assert not close(fresh.trainable_state(), pm.trainable_state())  # no moments: a step apart by ~lr, far above 1e-6
