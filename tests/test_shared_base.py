"""Tenants' LoRA training on one shared base (opentinker.backend.shared_base): a SharedAdapter
computes what a training client's own PrimitiveModel (peft) computes, its checkpoint files are
the same, and a tenant's logprobs, losses and gradients are the same whether other tenants' calls
share its pass or not. A failing call costs that call only."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from opentinker.backend.packed_linear import available as packed_available
from opentinker.backend.primitives import AdamParams, BadRequest, LoraShape, PrimitiveModel
from opentinker.backend.shared_base import SharedBase
from opentinker.model import load_model
from opentinker.tinker.wire import TokenDatum
from tests.rounding import same_call_metrics, same_grad, same_logprobs

ADAM = AdamParams(learning_rate=1e-2, beta1=0.8, beta2=0.9, eps=1e-6, weight_decay=0.1)


def datum(tokens, **inputs):
    targets = np.array(tokens[1:] + [2], np.int64)
    return TokenDatum(tokens=tokens, inputs={"target_tokens": targets, **{k: np.array(v, np.float32) for k, v in inputs.items()}})


# cross_entropy's soft targets ([N, K]: a distillation teacher's top-K and their probabilities)
SOFT = TokenDatum(tokens=[3, 60, 61], inputs={"target_tokens": np.array([[60, 7], [61, 8], [2, 9]], np.int64),
                                              "weights": np.array([[0.5, 0.5], [1, 0], [0.9, 0.1]], np.float32)})
CE = [datum([1, 50, 300, 7, 9], weights=[1, 1, 0.5, 1, 0]), datum([4, 800, 12], weights=[1, -1, 2])]
IS = [datum([5, 6, 7, 8, 9, 10], logprobs=[-1, -2, -3, -1, -2, -3], advantages=[0, 0, 1, 1, -1, 0]),
      datum([11, 12], logprobs=[-2, -2], advantages=[0.5, 0.5])]
PPO = [datum([40, 41, 42, 43], logprobs=[-3, -3, -3, -3], advantages=[0, 2, 2, 0])]
# tenant: (its LoRA, its loss, its data); ranks and trained modules differ
TENANTS = {"ann": (LoraShape(rank=4, seed=1), "cross_entropy", CE),
           "bob": (LoraShape(rank=8, seed=2, train_unembed=False), "importance_sampling", IS),
           "cyd": (LoraShape(rank=2, seed=3, train_attn=False), "ppo", PPO)}


def shared(gather_s: float = 0.0, joint: bool = True) -> SharedBase:
    """A base whose passes are joint (a GPU's default; on a CPU tenants take turns: joint=False),
    so that tenants' calls share passes here."""
    base, tok = load_model("tiny-random")
    return SharedBase(base, tok, "tiny-random", gather_s=gather_s, joint=joint)


def with_random_b(adapter, seed: int) -> None:
    """peft starts B at zero (the adapter equals the base): give it weights that matter."""
    gen = torch.Generator().manual_seed(100 + seed)
    with torch.no_grad():
        for _, b in adapter.adapter.weights.values():
            b.copy_(torch.randn(b.shape, generator=gen) * 0.2)


def grads_of(adapter) -> list[torch.Tensor | None]:
    return [None if p.grad is None else p.grad.clone() for p in adapter.params]


def unchanged(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    """The very same gradient, bit for bit: nothing ran (a refused call), or it was put back from
    its copy (a failed call), so no arithmetic can differ. Gradients computed again compare with
    tests.rounding.same_grad instead."""
    return (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))




def test_a_shared_adapter_computes_what_the_peft_trainer_does():
    sb = shared()
    mine = sb.attach("ann", LoraShape(rank=4, seed=0))
    with_random_b(mine, 0)
    base, tok = load_model("tiny-random")
    peft_model = PrimitiveModel(base, tok, "tiny-random", LoraShape(rank=4, seed=5))
    peft_model.load_state(mine.trainable_state(), None, 0)  # the same weights, under peft's own names
    for loss_fn, data in (("cross_entropy", CE), ("importance_sampling", IS)):
        ours, ours_metrics = mine.forward_backward(data, loss_fn, {})
        theirs, their_metrics = peft_model.forward_backward(data, loss_fn, {})
        assert all(same_logprobs(a["logprobs"], b["logprobs"]) for a, b in zip(ours, theirs))
        assert ours_metrics.keys() == their_metrics.keys()
        assert same_call_metrics(ours_metrics, their_metrics, data, theirs)
    named = dict(zip(mine.trainable_state(), grads_of(mine)))
    for name, param in peft_model.model.named_parameters():
        if param.requires_grad:
            assert same_grad(named[name], param.grad), name
    assert mine.optim_step(ADAM)["tokens:sum"] == peft_model.optim_step(ADAM)["tokens:sum"] == 16.0
    assert mine.steps == 1


def test_checkpoint_files_are_the_peft_trainers(tmp_path):
    """weights.safetensors and optimizer.pt load into a PrimitiveModel and back; the adapter/ folder loads in peft."""
    import io

    from peft import PeftModel
    from safetensors.torch import load

    sb = shared()
    mine = sb.attach("ann", LoraShape(rank=4, seed=0))
    with_random_b(mine, 0)
    mine.forward_backward(CE, "cross_entropy", {})
    mine.optim_step(ADAM)
    files = mine.state_files(with_optimizer=True)
    weights, optimizer = load(files["weights.safetensors"]), torch.load(io.BytesIO(files["optimizer.pt"]), weights_only=True)
    base, tok = load_model("tiny-random")
    peft_model = PrimitiveModel(base, tok, "tiny-random", LoraShape(rank=4, seed=5))
    peft_model.load_state(weights, optimizer, 1)  # would raise if names or the optimizer's parameter order differed
    back = sb.attach("ann-again", LoraShape(rank=4, seed=9))
    back.load_state(load(peft_model.state_files(with_optimizer=False)["weights.safetensors"]), optimizer, 1)
    assert all(torch.equal(a, b) for a, b in zip(back.params, mine.params))  # copied through two files: exact
    folder = tmp_path / "adapter"
    folder.mkdir()
    for name, data in files.items():
        if name.startswith("adapter/"):
            (folder / name.split("/", 1)[1]).write_bytes(data)
    reference = PeftModel.from_pretrained(load_model("tiny-random")[0], str(folder)).eval()
    ids = torch.tensor([[1, 50, 300, 7, 9]])
    with torch.no_grad(), sb.multi.rows(["ann"]):
        ours = sb.lm(input_ids=ids).logits
    assert same_logprobs(ours, reference(input_ids=ids).logits)  # logits: the same bound (no log-sum-exp to add)


def _tenants(sb: SharedBase) -> dict:
    adapters = {}
    for i, (name, (shape, _, _)) in enumerate(TENANTS.items()):
        adapters[name] = sb.attach(name, shape)
        with_random_b(adapters[name], i)
    return adapters


def test_each_tenant_gets_the_same_results_alone_or_sharing_a_pass():
    """Ann's call holds soft targets too: her [N, K] rows share the pass with the others' [N] rows."""
    calls = {name: (loss_fn, data + [SOFT] if name == "ann" else data) for name, (_, loss_fn, data) in TENANTS.items()}
    alone = {}
    for name, (loss_fn, data) in calls.items():
        sb = shared()
        adapters = _tenants(sb)  # the others exist but send nothing
        outputs, metrics = adapters[name].forward_backward(data, loss_fn, {})
        alone[name] = (outputs, metrics, grads_of(adapters[name]))
        assert sb.stats.shared == 0
    sb = shared(gather_s=0.5)  # calls that arrive within half a second share one pass
    adapters = _tenants(sb)
    results, start = {}, threading.Barrier(len(TENANTS))

    def call(name: str) -> None:
        loss_fn, data = calls[name]
        start.wait()
        results[name] = adapters[name].forward_backward(data, loss_fn, {})

    threads = [threading.Thread(target=call, args=(name,)) for name in TENANTS]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sb.stats.passes == 1 and sb.stats.calls == 3 and sb.stats.shared == 1  # one pass, every tenant's rows in it
    for name in TENANTS:
        outputs, metrics = results[name]
        want_outputs, want_metrics, want_grads = alone[name]
        assert all(same_logprobs(a["logprobs"], b["logprobs"]) for a, b in zip(outputs, want_outputs))
        assert same_call_metrics(metrics, want_metrics, calls[name][1], want_outputs)
        assert all(same_grad(got, want) for got, want in zip(grads_of(adapters[name]), want_grads)), name


def test_a_shared_pass_with_the_head_in_chunks_gets_the_same_results(monkeypatch):
    """Per-row adapters on the head hold when its logits are computed (and recomputed in the
    backward) a few positions at a time: each tenant's outputs and gradients are those of one chunk."""
    import opentinker.backend.primitives as primitives

    got = []
    for chunk in (0, 4):
        monkeypatch.setattr(primitives, "HEAD_CHUNK_POSITIONS", chunk)
        sb = shared(gather_s=0.5)
        adapters = _tenants(sb)
        for adapter in adapters.values():
            with_random_b(adapter, 1)
        results, start = {}, threading.Barrier(len(TENANTS))

        def call(name: str) -> None:
            _, loss_fn, data = TENANTS[name]
            start.wait()
            results[name] = adapters[name].forward_backward(data + ([SOFT] if name == "ann" else []), loss_fn, {})

        threads = [threading.Thread(target=call, args=(name,)) for name in TENANTS]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert sb.stats.shared == 1
        got.append({name: (results[name], grads_of(adapters[name])) for name in TENANTS})
    for name in TENANTS:
        ((out_a, _), g_a), ((out_b, _), g_b) = got[0][name], got[1][name]
        assert all(same_logprobs(a["logprobs"], b["logprobs"]) for a, b in zip(out_a, out_b)), name
        assert all(same_grad(a, b) for a, b in zip(g_b, g_a)), name


def test_a_step_changes_only_its_own_adapter():
    sb = shared(gather_s=0.2)
    adapters = _tenants(sb)
    for name, (_, loss_fn, data) in TENANTS.items():
        adapters[name].forward_backward(data, loss_fn, {})
    before = {n: [p.detach().clone() for p in a.params] for n, a in adapters.items()}
    grads = {n: grads_of(a) for n, a in adapters.items()}
    adapters["bob"].optim_step(ADAM)
    for name, adapter in adapters.items():
        changed = [not torch.equal(p, q) for p, q in zip(adapter.params, before[name])]
        assert any(changed) == (name == "bob"), name
        if name != "bob":  # and its accumulated gradient is still there, untouched
            assert all(torch.equal(g, p.grad) for g, p in zip(grads[name], adapter.params) if g is not None)  # not touched: exact


def test_a_bad_call_or_a_tenant_gone_mid_pass_fails_only_that_call():
    sb = shared(gather_s=0.5)
    adapters = _tenants(sb)
    with pytest.raises(BadRequest, match=r"data\[0\]\.model_input: token ids must be in \[0, "):
        adapters["ann"].forward_backward([datum([1, 10**6, 3], weights=[1, 1, 1])], "cross_entropy", {})
    assert sb.stats.passes == 0  # refused before it reached the model
    errors, results, start = {}, {}, threading.Barrier(3)

    def call(name: str) -> None:
        _, loss_fn, data = TENANTS[name]
        start.wait()
        try:
            results[name] = adapters[name].forward_backward(data, loss_fn, {})
        except Exception as err:  # noqa: BLE001
            errors[name] = err

    threads = [threading.Thread(target=call, args=(name,)) for name in TENANTS]
    for t in threads:
        t.start()
    threading.Event().wait(0.1)
    adapters["cyd"].close()  # cyd's session ends while its call waits for the pass
    for t in threads:
        t.join()
    assert set(results) == {"ann", "bob"} and set(errors) == {"cyd"}
    assert str(errors["cyd"]) == "model 'cyd' was closed while its call waited"
    alone = shared()
    again = _tenants(alone)
    want, _ = again["ann"].forward_backward(CE, "cross_entropy", {})
    assert all(same_logprobs(a["logprobs"], b["logprobs"]) for a, b in zip(results["ann"][0], want))
    assert all(same_grad(a, b) for a, b in zip(grads_of(adapters["ann"]), grads_of(again["ann"])))


def test_a_pass_that_raises_is_run_call_by_call_so_only_the_failing_call_fails():
    """A call that breaks the shared pass itself (here: a target id past the vocabulary, which only
    the adapter's own check would have refused) fails alone; the others' results and gradients are
    those of a pass without it (the failed pass's gradients were put back)."""
    from concurrent.futures import Future

    from opentinker.backend.shared_calls import TinkerCall

    sb = shared(gather_s=0.5)
    adapters = _tenants(sb)
    rows = [{"tokens": torch.tensor([1, 2, 3]), "target_tokens": torch.tensor([2, 3, 10**6]), "weights": torch.ones(3)}]
    broken = TinkerCall("bob", rows, "cross_entropy", {}, False, Future())
    results = {}

    def good() -> None:
        results["ann"] = adapters["ann"].forward_backward(CE, "cross_entropy", {})

    thread = threading.Thread(target=good)
    sb._calls.put(broken)
    thread.start()
    thread.join()
    with pytest.raises(RuntimeError, match="index"):
        broken.future.result()
    assert sb.stats.passes == 3 and sb.stats.split == 1 and sb.stats.shared == 0  # the shared pass failed, then each call alone
    assert all(g is None for g in grads_of(adapters["bob"]))  # nothing of the broken pass stayed
    again = _tenants(shared())
    want, _ = again["ann"].forward_backward(CE, "cross_entropy", {})
    assert all(same_logprobs(a["logprobs"], b["logprobs"]) for a, b in zip(results["ann"][0], want))
    assert all(same_grad(a, b) for a, b in zip(grads_of(adapters["ann"]), grads_of(again["ann"])))


def test_an_adapter_the_memory_bound_cannot_hold_is_refused_with_the_numbers():
    """The base and its adapters' training state (weights, gradients, AdamW moments) stay within the
    worker's memory bound: one more client that would not fit is refused before anything is allocated."""
    probe = shared()
    base_bytes = probe.base_bytes()
    params = sum(p.numel() * p.element_size() for p in probe.lm.parameters())
    packed = sum(lin.weight.numel() * 4 for lin in probe.multi.linears.values())  # the sampling engine's packed copy on a CPU
    assert base_bytes == params + (packed if packed_available() else 0)
    one = probe.training_bytes(8, LoraShape(rank=8).spec().target_modules)
    assert one == 20 * sum(8 * (lin.in_features + lin.out_features) for lin in probe.multi.linears.values())  # every target, r (in + out)
    base, tok = load_model("tiny-random")
    sb = SharedBase(base, tok, "tiny-random", memory_bytes=base_bytes + 2.5 * one)
    sb.attach("a", LoraShape(rank=8))
    sb.attach("b", LoraShape(rank=8))
    with pytest.raises(BadRequest, match=r"^lora_config\.rank 8: this client's adapter needs \d+ MiB \(weights, gradients, AdamW "
                                         r"moments, sampling copy\); the worker of tiny-random has \d+ MiB left of \d+ MiB \(the base "
                                         r"with its packed copy \d+ MiB, 2 adapter\(s\) \d+ MiB\): a smaller rank, or when another "
                                         r"session has ended$"):
        sb.attach("c", LoraShape(rank=8))
    assert "c" not in sb.multi
    sb.attach("c", LoraShape(rank=2))  # a quarter of the size fits in what is left


def test_samplers_of_several_adapters_share_a_batch_and_each_gets_what_it_gets_alone(tmp_path):
    """Sampling on the shared base (MultiLoraEngine): snapshots of three adapters and the base
    alone, asked together, run as one batch, each row through its own adapter; greedy tokens and
    logprobs are what each request gets run alone."""
    from opentinker.backend.rollout import SamplingParams
    from opentinker.inference.engine_multi_lora import MultiLoraEngine

    sb = shared()
    adapters = _tenants(sb)
    engine = MultiLoraEngine(sb)
    for name, adapter in adapters.items():
        folder = tmp_path / name
        folder.mkdir()
        for file, data in adapter.state_files(with_optimizer=False).items():
            if file.startswith("adapter/"):
                (folder / file.split("/", 1)[1]).write_bytes(data)
        engine.load_adapter(f"{name}:sample:0", str(folder))
    asks = {"ann:sample:0": [5, 6, 7, 8], "bob:sample:0": [9, 10], "cyd:sample:0": [11, 12, 13], None: [5, 6, 7, 8]}
    params = SamplingParams(max_new_tokens=5, greedy=True)
    alone = {name: engine.generate([prompt, prompt], [5, 3], params, adapter=name).result() for name, prompt in asks.items()}
    assert engine.mixed == 0
    stream = engine.rollout.stream
    together = {name: stream.sequences([prompt, prompt], params, [5, 3], adapters=[name, name]) for name, prompt in asks.items()}
    stream.enqueue([seq for seqs in together.values() for seq in seqs])  # the four requests join the batch at one step
    results = {name: [seq.future.result() for seq in seqs] for name, seqs in together.items()}
    assert engine.mixed >= 1  # forwards whose rows went through several adapters
    for name, completions in results.items():
        for got, want in zip(completions, alone[name]):
            assert got.token_ids == want.token_ids and same_logprobs(got.logprobs, want.logprobs), name
    assert alone["ann:sample:0"][0].token_ids != alone[None][0].token_ids or not same_logprobs(
        alone["ann:sample:0"][0].logprobs, alone[None][0].logprobs)  # the adapter changes what the base says
    engine.unload_adapter("bob:sample:0")
    assert "bob:sample:0" not in sb.multi and "bob" in sb.multi  # the snapshot leaves, the training adapter stays
    engine.close()


def _long_call(n_rows: int, start: int = 100) -> list:
    return [datum([start + 7 * r + i for i in range(6)], weights=[1.0] * 6) for r in range(n_rows)]


def test_a_call_in_pieces_computes_what_it_computes_in_one_pass():
    """A call longer than a pass runs in pieces (here a row each); its outputs, metrics and
    gradient are those of one pass over every row."""
    data = _long_call(5) + CE
    whole = shared()
    alone = _tenants(whole)["ann"]
    want_out, want_metrics = alone.forward_backward(data, "cross_entropy", {})
    sb = shared()
    sb.pass_tokens = 6  # every row a piece of its own
    mine = _tenants(sb)["ann"]
    passes = sb.stats.passes
    got_out, got_metrics = mine.forward_backward(data, "cross_entropy", {})
    assert sb.stats.passes - passes == len(data)
    # the same sums in another order (a piece's gradient added to the last's): float32's bound for
    # the pass (tests/rounding.py), not one CPU's rounding (an AMX machine's gap was 1.06e-5)
    assert all(same_logprobs(a["logprobs"], b["logprobs"]) for a, b in zip(got_out, want_out))
    assert same_call_metrics(got_metrics, want_metrics, data, want_out)
    assert all(same_grad(a, b) for a, b in zip(grads_of(mine), grads_of(alone)))


def test_tenants_take_turns_so_a_small_call_waits_for_one_piece_of_a_large_one():
    """A neighbour's large call does not hold the base: passes alternate between the tenants with
    work queued, so a small call that arrives meanwhile runs after at most one of the neighbour's pieces
    (a CPU's passes: one tenant's piece each)."""
    sb = shared(joint=False)
    sb.pass_tokens = 6
    adapters = _tenants(sb)
    ran: list[list[str]] = []
    original = sb._pass

    def recording(pieces):
        ran.append([call.adapter for call, _ in pieces])
        time.sleep(0.02)  # a pass that takes a while, so the small call arrives mid-call
        return original(pieces)

    sb._pass = recording
    big = threading.Thread(target=adapters["bob"].forward_backward, args=(_long_call(40), "cross_entropy", {}))
    big.start()
    while len(ran) < 3:
        time.sleep(0.005)
    adapters["ann"].forward_backward(CE, "cross_entropy", {})  # two rows: two pieces
    mine = [i for i, adapters_in in enumerate(ran) if adapters_in == ["ann"]]
    big.join()
    assert len(mine) == 2 and mine[1] - mine[0] == 2 and ran[mine[0] - 1] == ["bob"]  # ann, bob, ann: turns, one piece each
    assert len(ran) == 42 and ran.count(["bob"]) == 40


def test_a_call_whose_model_closes_is_abandoned_at_its_next_pass_boundary():
    """A session that ends (closed, or expired because its client is gone) takes its adapter off:
    its running call stops at the next pass boundary instead of running to its end."""
    sb = shared()
    sb.pass_tokens = 6
    adapters = _tenants(sb)
    passes: list[str] = []
    original = sb._pass

    def recording(pieces):
        passes.append(pieces[0][0].adapter)
        time.sleep(0.02)
        return original(pieces)

    sb._pass = recording
    errors = []

    def call() -> None:
        try:
            adapters["bob"].forward_backward(_long_call(200), "cross_entropy", {})
        except BadRequest as err:
            errors.append(str(err))

    thread = threading.Thread(target=call)
    thread.start()
    while len(passes) < 3:
        time.sleep(0.005)
    adapters["bob"].close()
    closed_at = len(passes)
    thread.join(timeout=30)
    assert errors == ["model 'bob' was closed while its call ran"]
    assert len(passes) <= closed_at + 1  # the pass running when it closed, none after


def test_a_call_that_fails_in_a_later_piece_takes_back_what_its_earlier_pieces_added():
    """A call fails as a whole: a bad row in its third piece (a target past the vocabulary, which
    the adapter's own check would have refused) leaves the adapter's gradient as it was before the call."""
    from concurrent.futures import Future

    from opentinker.backend.shared_calls import TinkerCall

    sb = shared()
    sb.pass_tokens = 6
    adapters = _tenants(sb)
    adapters["ann"].forward_backward(CE, "cross_entropy", {})
    before = grads_of(adapters["ann"])
    rows = [{"tokens": torch.tensor([1, 2, 3]), "target_tokens": torch.tensor([2, 3, 4]), "weights": torch.ones(3)},
            {"tokens": torch.tensor([1, 2, 3, 4]), "target_tokens": torch.tensor([2, 3, 4, 5]), "weights": torch.ones(4)},
            {"tokens": torch.tensor([1, 2, 3, 4, 5]), "target_tokens": torch.tensor([2, 3, 4, 5, 10**6]), "weights": torch.ones(5)}]
    broken = TinkerCall("ann", rows, "cross_entropy", {}, False, Future())
    with pytest.raises(RuntimeError, match="index"):
        sb.submit(broken)
    assert sb.stats.passes >= 4  # ran a piece at a time: two good pieces, then the failing one
    assert all(unchanged(a, b) for a, b in zip(grads_of(adapters["ann"]), before))


def test_a_training_client_on_a_base_of_its_own_stops_its_call_at_the_next_micro_batch_once_closed():
    """The same rule without a shared base (a session's own actor): closed mid-call, the running
    call raises before its next micro-batch."""
    base, tok = load_model("tiny-random")
    model = PrimitiveModel(base, tok, "tiny-random", LoraShape(rank=4, seed=0))
    batches = []
    original = model._target_logprobs

    def recording(*args, **kwargs):
        batches.append(1)
        if len(batches) == 2:
            model.close()  # its session ends while the call runs
        return original(*args, **kwargs)

    model._target_logprobs = recording
    rows = [datum([100 + 7 * r + i for i in range(8)], weights=[1.0] * 8) for r in range(6)]
    with pytest.MonkeyPatch.context() as mp:  # a micro-batch a row
        mp.setattr("opentinker.backend.primitives.micro_batches", lambda lengths: [[i] for i in range(len(lengths))])
        with pytest.raises(BadRequest, match="the model was closed while its call ran"):
            model.forward_backward(rows, "cross_entropy", {})
    assert len(batches) == 2


def test_the_pass_memory_rule_counts_what_its_docstring_says():
    """pass_bytes(t) = CALIBRATION * t * L * (10 h + 4 i) * s + 3 * min(t, chunk) * V * 4, by hand for the tiny model."""
    from opentinker.backend.pass_memory import CALIBRATION, PassMemory

    sb = shared()
    text = sb.lm.config.get_text_config()
    L, h, i, V = text.num_hidden_layers, text.hidden_size, text.intermediate_size, text.vocab_size
    rule = PassMemory.of(sb.lm.config, 4, 8)
    assert rule.pass_bytes(20) == pytest.approx(CALIBRATION * 20 * L * (10 * h + 4 * i) * 4 + 3 * 8 * V * 4)
    assert rule.pass_bytes(5) == pytest.approx(CALIBRATION * 5 * L * (10 * h + 4 * i) * 4 + 3 * 5 * V * 4)
    room = rule.pass_bytes(20) + 1
    assert rule.tokens_within(room) == 20 and rule.tokens_within(rule.pass_bytes(5) + 1) == 5 and rule.tokens_within(1.0) == 0
    assert sb.pass_memory.head_chunk == 512 and sb.pass_room() is None and sb.pass_budget() == sb.pass_tokens


def test_passes_are_sized_to_the_memory_left_and_a_datum_no_pass_can_hold_is_refused_before_it_runs():
    """With the worker's memory bound set so that a pass holds 6 tokens, a call runs in pieces that
    fit (the same results as one pass), and a datum whose own pass would not fit is refused in one
    line, with nothing run and no gradient added."""
    from opentinker.backend.pass_memory import PASS_SHARE

    data = _long_call(5) + CE
    whole = shared()
    alone = _tenants(whole)["ann"]
    want_out, want_metrics = alone.forward_backward(data, "cross_entropy", {})
    sb = shared()
    mine = _tenants(sb)["ann"]
    room = sb.pass_memory.pass_bytes(6) + 1.0  # 6 tokens fit, 7 do not
    sb.memory_bytes = sb.base_bytes() + sb.held_bytes() + room / PASS_SHARE
    assert sb.pass_room() == pytest.approx(room) and sb.pass_budget() == 6
    passes = sb.stats.passes
    got_out, got_metrics = mine.forward_backward(data, "cross_entropy", {})
    assert sb.stats.passes - passes == len(data)  # every row (5 or 6 tokens) a pass of its own
    assert all(same_logprobs(a["logprobs"], b["logprobs"]) for a, b in zip(got_out, want_out))
    assert same_call_metrics(got_metrics, want_metrics, data, want_out)
    before, passes = grads_of(mine), sb.stats.passes
    too_long = datum(list(range(100, 107)), weights=[1.0] * 7)
    with pytest.raises(BadRequest, match=r"^data\[1\]: 7 tokens need about [\d,]+ MiB in a pass and the worker of tiny-random has "
                                         r"[\d,]+ MiB for passes \(docs/tinker.md, 'Pass memory'\): send shorter datums, or ask "
                                         r"the operator for more worker memory$"):
        mine.forward_backward([CE[1], too_long], "cross_entropy", {})
    assert sb.stats.passes == passes and all(unchanged(a, b) for a, b in zip(grads_of(mine), before))
