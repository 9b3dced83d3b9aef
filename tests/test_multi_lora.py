"""Many LoRA adapters on one base, one batch (opentinker.backend.multi_lora): each row of a mixed
batch gets what a peft model with that row's adapter alone gives it, logits and gradients."""

import copy

import pytest
import torch

from opentinker.backend.multi_lora import MultiLora, grouped_rows
from tests.rounding import BF16_FORWARD, BF16_PASS, same_grad, same_logprobs

RANKS = {"x": 2, "y": 4, "z": 8}
ALPHA = {"x": 4.0, "y": 16.0, "z": 8.0}
TARGETS = {"x": None, "y": ["q_proj", "v_proj", "down_proj"], "z": None}  # None: all seven projections
ROWS = ["y", None, "x", "z", "x", "y"]  # a row without adapter, rows of one adapter apart


@pytest.fixture(scope="module")
def base():
    from opentinker.core.model_names import TINY
    from opentinker.model import load_model

    return load_model(TINY)[0]


@pytest.fixture(scope="module")
def tokens():
    return torch.randint(3, 1000, (len(ROWS), 7), generator=torch.Generator().manual_seed(0))


def _multi(base, optimizer=None):
    """A fresh MultiLora on a copy of the base, adapters x, y, z with random B (peft's default B
    is zero: every adapter would equal the base)."""
    multi = MultiLora(copy.deepcopy(base))
    for i, name in enumerate(RANKS):
        adapter = multi.add(name, r=RANKS[name], alpha=ALPHA[name], target_modules=TARGETS[name], seed=i, optimizer=optimizer)
        gen = torch.Generator().manual_seed(100 + i)
        with torch.no_grad():
            for _, b in adapter.weights.values():
                b.copy_(torch.randn(b.shape, generator=gen) * 0.3)
    return multi


def _peft(base, multi):
    """The reference: one peft model holding x, y, z (LoraConfig as each was made), weights copied in."""
    from peft import LoraConfig, get_peft_model

    model = None
    for name, adapter in multi.adapters.items():
        config = LoraConfig(r=adapter.r, lora_alpha=adapter.alpha, target_modules=list(adapter.target_modules), task_type="CAUSAL_LM")
        if model is None:
            model = get_peft_model(copy.deepcopy(base), config, adapter_name=name)
        else:
            model.add_adapter(name, config)
    with torch.no_grad():
        for name, adapter in multi.adapters.items():
            for path, (a, b) in adapter.weights.items():
                layer = model.base_model.model.get_submodule(path)
                layer.lora_A[name].weight.copy_(a)
                layer.lora_B[name].weight.copy_(b)
    return model


def _peft_logits(model, name, ids):
    if name is None:
        with model.disable_adapter():
            return model(input_ids=ids).logits
    model.set_adapter(name)
    return model(input_ids=ids).logits


def _loss(logits, ids):
    """Next-token cross-entropy summed over rows and positions: row losses add, so do gradients."""
    return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten(), reduction="sum")


def test_each_row_of_a_mixed_batch_gets_its_own_adapter(base, tokens):
    multi = _multi(base)
    ref = _peft(base, multi)
    with torch.no_grad():
        mixed = multi(ROWS, input_ids=tokens).logits
        plain = multi.model(input_ids=tokens).logits  # outside rows(...): the base
        assert torch.equal(plain, base(input_ids=tokens).logits)  # each layer runs the base's own F.linear: exact
        for i, name in enumerate(ROWS):  # a row of a batch against peft's: the same sums in other orders (tests/rounding.py)
            alone = _peft_logits(ref, name, tokens[i:i + 1])
            assert same_logprobs(mixed[i:i + 1], alone), f"row {i} ({name})"
            if name is not None:  # the adapter really changes the row (the test could fail)
                assert not same_logprobs(mixed[i], plain[i])


def test_a_mixed_batch_runs_its_adapters_as_batched_matmuls_when_padding_is_small(base):
    """The batch of ROWS (groups of 2, 2 and 1) takes the batched path the tests above check
    against peft; groups far apart in size, or dropout, keep the per-adapter loop."""
    multi = _multi(base)
    rows = lambda *ix: torch.tensor(ix)  # noqa: E731
    grouped = grouped_rows(((multi["y"], rows(0, 5)), (multi["x"], rows(2, 4)), (multi["z"], rows(3))), 6)
    assert grouped is not None and grouped.width == 2 and not grouped.in_order
    assert grouped.index.tolist() == [0, 5, 2, 4, 3, 3] and grouped.keep.tolist() == [1, 1, 1, 1, 1, 0]
    in_order = grouped_rows(((multi["x"], rows(0, 1)), (multi["y"], rows(2, 3))), 4)  # viewed, not gathered
    assert in_order.in_order and in_order.keep is None
    assert not grouped_rows(((multi["x"], rows(0, 1)), (multi["y"], rows(2, 3))), 5).in_order  # a base row follows
    assert grouped_rows(((multi["x"], rows(0)), (multi["y"], rows(1, 2, 3, 4))), 5) is None  # 8 padded rows for 5
    alone = grouped_rows(((multi["x"], rows(0, 1, 2)),), 3)  # one adapter, the whole batch: viewed
    assert alone.in_order and alone.width == 3
    assert grouped_rows(((multi["x"], rows(0, 2)),), 3) is None  # one adapter beside a base row
    multi.add("wet", r=2, dropout=0.1, seed=5)
    assert grouped_rows(((multi["x"], rows(0)), (multi["wet"], rows(1))), 2) is None


def test_a_mixed_batch_of_a_bfloat16_base_runs_forward_and_backward_as_each_adapter_alone(base, tokens):
    """A GPU's base computes in bfloat16 while adapters train in float32: ROWS' groups of unequal
    size take the batched path with its padding mask (which once turned the delta float32, so that
    every such pass on a GPU failed: Tinker passes then fell back to one tenant at a time)."""
    multi = _multi(base)
    multi.model.to(torch.bfloat16)
    mixed_ids = tokens[:, :5]
    mixed = multi(ROWS, input_ids=mixed_ids).logits.float()
    assert mixed.dtype == torch.float32 and torch.isfinite(mixed).all()
    _loss(mixed, mixed_ids).backward()
    grads = {n: [p.grad.clone() for p in multi[n].parameters()] for n in RANKS}
    for n in RANKS:
        for p in multi[n].parameters():
            p.grad = None
    for i, name in enumerate(ROWS):
        alone = multi([name], input_ids=mixed_ids[i:i + 1]).logits.float()
        assert same_logprobs(mixed[i:i + 1], alone, rel=BF16_FORWARD), f"row {i} ({name})"  # a unit of bf16 a stage
        if name is not None:
            _loss(alone, mixed_ids[i:i + 1]).backward()
    for n in RANKS:
        for g, p in zip(grads[n], multi[n].parameters()):
            assert g.dtype == torch.float32
            assert same_grad(g, p.grad, rel=BF16_PASS)


def test_a_batch_in_adapter_order_with_kept_stacks_gives_each_row_its_adapter(base, tokens):
    """Rows already grouped by adapter (viewed, not gathered) and, without grad, the adapters'
    stacked weights kept between passes: still each row's own adapter, also after an adapter
    changed in place (its stacks are made again)."""
    multi = _multi(base)
    ref = _peft(base, multi)
    order, ids = ["x", "x", "z", "z"], tokens[:4]
    with torch.no_grad():  # one adapter over the whole batch
        assert same_logprobs(multi(["z"] * 4, input_ids=ids).logits, _peft_logits(ref, "z", ids))  # peft's order: tests/rounding.py
    with torch.no_grad():
        for change in (False, False, True):  # the second pass reuses the stacks; the third follows a change
            if change:
                for path, (_, b) in multi["z"].weights.items():
                    b.mul_(2.0)
                    ref.base_model.model.get_submodule(path).lora_B["z"].weight.mul_(2.0)
            mixed = multi(order, input_ids=ids).logits
            for i, name in enumerate(order):
                assert same_logprobs(mixed[i:i + 1], _peft_logits(ref, name, ids[i:i + 1]))


def test_gradients_of_a_mixed_batch_are_each_adapters_own(base, tokens):
    multi = _multi(base)
    multi.add("idle", r=4, seed=9)  # registered, no row in the batch
    ref = _peft(base, multi)
    _loss(multi(ROWS, input_ids=tokens).logits, tokens).backward()
    for name in RANKS:
        ref.set_adapter(name)  # peft: only the active adapter is trainable
        rows = [i for i, n in enumerate(ROWS) if n == name]
        _loss(ref(input_ids=tokens[rows]).logits, tokens[rows]).backward()
        for path, pair in multi[name].weights.items():
            layer = ref.base_model.model.get_submodule(path)
            for ours, theirs in zip(pair, (layer.lora_A[name].weight.grad, layer.lora_B[name].weight.grad)):
                assert ours.grad is not None and ours.grad.abs().max() > 0
                assert same_grad(ours.grad, theirs), f"{name} {path}"  # a batch's sums against peft's rows: tests/rounding.py
    assert all(p.grad is None for p in multi["idle"].parameters())
    assert all(p.grad is None and not p.requires_grad for p in multi.model.parameters())


def test_an_optimizer_step_changes_only_its_adapter(base, tokens):
    multi = _multi(base, optimizer={"lr": 1e-2, "weight_decay": 0.1})
    before = {n: [p.detach().clone() for p in multi[n].parameters()] for n in RANKS}
    base_before = base.state_dict()  # the unwrapped base: same names, same values
    _loss(multi(ROWS, input_ids=tokens).logits, tokens).backward()
    multi["x"].step()
    assert multi["x"].steps == 1 and all(p.grad is None for p in multi["x"].parameters())
    assert all(not torch.equal(p, q) for p, q in zip(multi["x"].parameters(), before["x"]))
    for name in ("y", "z"):  # they hold grads from the batch, but their weights did not move
        assert all(torch.equal(p, q) for p, q in zip(multi[name].parameters(), before[name]))
        assert all(p.grad is not None for p in multi[name].parameters())
        assert {id(p) for g in multi[name].optimizer.param_groups for p in g["params"]} == {id(p) for p in multi[name].parameters()}
    after = multi.model.state_dict()  # after the step
    assert set(after) == set(base_before) and all(torch.equal(after[k], v) for k, v in base_before.items())


def test_row_order_does_not_matter(base, tokens):
    multi = _multi(base)
    order = torch.tensor([3, 0, 5, 1, 4, 2])
    with torch.no_grad():
        straight = multi(ROWS, input_ids=tokens).logits
        shuffled = multi([ROWS[i] for i in order], input_ids=tokens[order]).logits
    assert same_logprobs(shuffled, straight[order])  # rows gathered in another order: tests/rounding.py


def test_greedy_decoding_of_a_mixed_batch_matches_each_adapter_alone(base, tokens):
    multi = _multi(base)
    ids = tokens[:, :4]
    kwargs = {"max_new_tokens": 5, "do_sample": False, "pad_token_id": 2, "eos_token_id": None}
    with torch.no_grad(), multi.rows(ROWS):  # the KV cache keeps the batch's rows in place
        mixed = multi.model.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
    for name in set(ROWS):  # each adapter on its own rows only
        rows = [i for i, n in enumerate(ROWS) if n == name]
        with torch.no_grad(), multi.rows([name] * len(rows)):
            alone = multi.model.generate(ids[rows], attention_mask=torch.ones_like(ids[rows]), **kwargs)
        assert mixed[rows].tolist() == alone.tolist(), name
    assert len({tuple(t) for t in mixed[:, 4:].tolist()}) > 2  # adapters steer the rows apart


def test_an_adapter_round_trips_through_a_peft_folder(base, tokens, tmp_path):
    from peft import PeftModel

    multi = _multi(base)
    folder = multi.save("y", tmp_path / "y")
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in folder.iterdir()}
    with torch.no_grad():
        theirs = PeftModel.from_pretrained(copy.deepcopy(base), str(folder))(input_ids=tokens).logits
        ours = multi(["y"] * len(ROWS), input_ids=tokens).logits
        assert same_logprobs(ours, theirs)  # peft's order: tests/rounding.py
        multi.load("y2", folder)
        assert (multi["y2"].r, multi["y2"].scale, multi["y2"].target_modules) == (4, 4.0, ("down_proj", "q_proj", "v_proj"))
        assert torch.equal(multi(["y2"] * len(ROWS), input_ids=tokens).logits, ours)  # the same weights, bit for bit, the same kernels: exact
    assert set(multi.adapter_files("y")) >= {"adapter/adapter_config.json", "adapter/adapter_model.safetensors"}
    with pytest.raises(ValueError, match="exists already"):
        multi.load("y", folder)
    with pytest.raises(KeyError, match="unknown adapters"):
        multi(["nope"], input_ids=tokens[:1])
