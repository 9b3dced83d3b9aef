"""Packed linears (opentinker.backend.packed_linear): the sampling engines' matmuls on oneDNN's
packed weights give the plain model's results (float32, summation order only), leave autograd
alone, follow weights that change, and keep an adapter engine's merged adapters apart."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from opentinker.backend.packed_linear import PackedLinear, available, pack_linears, repack
from tests.rounding import order_gap, same_logprobs, within

pytestmark = pytest.mark.skipif(not available(), reason="this torch has no oneDNN packed linear")


def _same_product(got: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> bool:
    """got is x @ weight.T (+ bias) in another summation order: each output within order_gap(n + 1)
    of Σ|x·w| + |bias| over its terms (tests/rounding.py)."""
    with torch.no_grad():
        want, terms = x @ weight.T, x.abs() @ weight.abs().T
        if bias is not None:
            want, terms = want + bias, terms + bias.abs()
    return within(got, want, order_gap(x.shape[-1] + 1) * float(terms.max()))


def test_a_packed_linear_gives_the_plain_result_and_keeps_autograd():
    torch.manual_seed(0)
    plain = nn.Linear(96, 160)
    layer = PackedLinear(plain)
    layer.packing = True
    x = torch.randn(8, 3, 96)
    with torch.no_grad():
        expected = plain(x)
        got = layer(x)
    assert layer._packed is not None and _same_product(got, x, plain.weight, plain.bias)
    # with grad: the stored weight, bit for bit, and gradients flow to the input and the weight
    x.requires_grad_(True)
    out = layer(x)
    assert torch.equal(out, plain(x))
    out.sum().backward()
    assert x.grad is not None and layer.weight.grad is not None
    # d sum/dx sums each input's column of the weight over its 160 outputs, in autograd's order or sum's
    column = layer.weight.detach().sum(0)
    assert within(x.grad, column.expand_as(x), order_gap(160) * float(layer.weight.detach().abs().sum(0).max()))


def test_a_changed_weight_is_packed_again():
    torch.manual_seed(1)
    layer = PackedLinear(nn.Linear(64, 64, bias=False))
    layer.packing = True
    x = torch.randn(4, 64)
    with torch.no_grad():
        before = layer(x)
        layer.weight.add_(1.0)  # an in-place change bumps the version: noticed
        assert _same_product(layer(x), x, layer.weight) and not _same_product(before, x, layer.weight)
        layer.weight.data += 1.0  # through .data (as peft merges): the owner calls repack
        repack(layer)
        assert _same_product(layer(x), x, layer.weight)
        layer.weight = nn.Parameter(torch.randn(64, 64))  # a new tensor: noticed
        assert _same_product(layer(x), x, layer.weight)


def test_a_packed_model_decodes_as_the_plain_one(tiny):
    model, _ = tiny
    model.eval()
    names = set(model.state_dict())
    ids = torch.randint(0, model.config.vocab_size, (3, 12))
    with torch.no_grad():
        expected = model(input_ids=ids).logits
        assert pack_linears(model) > 0
        got = model(input_ids=ids).logits
    assert set(model.state_dict()) == names  # parameter names (checkpoints) unchanged
    assert all(type(m) is not nn.Linear for m in model.modules())
    if model.config.tie_word_embeddings:
        assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    assert same_logprobs(got, expected)  # logits in other orders: tests/rounding.py
    loss = model(input_ids=ids, labels=ids).loss  # training a packed model: autograd as before
    loss.backward()
    assert model.get_input_embeddings().weight.grad is not None


def test_an_adapter_engine_keeps_merged_adapters_apart(tmp_path, tiny_path):
    """A float32 adapter engine merges the batch's adapter into the (packed) weights and unmerges
    it for the next: each adapter's logprobs are its own whatever came before it."""
    from opentinker.core.spec import LoraSpec
    from opentinker.inference.engine_hf import HFEngine
    from opentinker.model import load_model, wrap_model

    base, tokenizer = load_model(tiny_path)
    prompt = tokenizer("the packed weights follow the adapter")["input_ids"]
    expected = {}
    for seed in (1, 2):
        model = wrap_model(load_model(tiny_path)[0], LoraSpec(r=4, alpha=8))
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_" in name:
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
            logp = torch.log_softmax(model(input_ids=torch.tensor([prompt])).logits[0, :-1], -1)
        expected[f"a{seed}"] = logp.gather(-1, torch.tensor(prompt[1:])[:, None]).squeeze(-1)
        model.save_pretrained(tmp_path / f"a{seed}")
    engine = HFEngine.for_adapters(str(tiny_path))
    try:
        assert engine.merges
        for name in ("a1", "a2"):
            engine.load_adapter(name, str(tmp_path / name))
        for name in ("a1", "a2", "a1", "a2"):
            got = torch.tensor(engine.score_prompt(prompt, adapter=name)[0][1:])
            assert same_logprobs(got, expected[name].float()), name  # merged against beside: other orders
    finally:
        engine.close()
