"""The Tinker API through the unmodified `tinker` SDK (pinned 0.38.0): training, sampling,
checkpoints and the REST client against the gateway's routes, with the sessions in this process
(the stack's own session path, a flow run with a Ray actor, is tests/test_tinker_stack.py).

Numbers are checked against values computed here from the model's own forward pass: each loss
from the learner's logprobs, sampled logprobs against the trainer's recompute (float32: within
the bound of tests/rounding.py), the resumed client's next step against the uninterrupted one's."""

from __future__ import annotations

import math

import numpy as np
import pytest

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402

from tests.rounding import logprob_gap, same_logprobs, same_metric  # noqa: E402

BASE = "tiny-random"
EOS = 2


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    from opentinker.control.gateway.tinker_local import local_gateway

    url, keys, sessions, server = local_gateway(tmp_path_factory.mktemp("tinker"), tenants=("alice", "bob"))
    yield url, keys, sessions
    server.stop()
    sessions.close()


@pytest.fixture(scope="module")
def service(gateway, monkeypatch_module):
    url, keys, _ = gateway
    client = tinker.ServiceClient(base_url=url, api_key=keys["alice"])
    yield client
    client.close("success")


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    mp.setenv("TINKER_TELEMETRY", "0")
    yield mp
    mp.undo()


@pytest.fixture(scope="module")
def trainer(service):
    return service.create_lora_training_client(base_model=BASE, rank=8, seed=0).result()


@pytest.fixture
def fresh(service):
    """A training client of its own (its gradients and steps touch no other test)."""
    return service.create_lora_training_client(base_model=BASE, rank=4, seed=1).result()


def datum(tokens: list[int], **inputs) -> types.Datum:
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                       loss_fn_inputs={"target_tokens": tokens[1:], **inputs})


def seq(start: int, n: int = 12) -> list[int]:
    return [(start * 37 + 11 * i) % 5000 + 100 for i in range(n)]


def lp_of(out, i: int) -> np.ndarray:
    return np.asarray(out.loss_fn_outputs[i]["logprobs"].tolist(), dtype=np.float64)


def test_capabilities_and_info(service, trainer):
    """Capabilities list what the operator serves; get_info names the model, its rank and a local tokenizer."""
    names = [m.model_name for m in service.get_server_capabilities().supported_models]
    assert {"smollm2-135m-instruct", "tiny-random", "HuggingFaceTB/SmolLM2-135M-Instruct"} <= set(names)
    info = trainer.get_info()
    assert info.model_data.model_name == BASE and info.lora_rank == 8 and info.is_lora
    tokenizer = trainer.get_tokenizer()  # from the local folder get_info names: no model hub
    assert tokenizer.encode("hello", add_special_tokens=False)


def test_forward_has_no_effect_and_cross_entropy_is_a_weighted_sum(trainer):
    """forward() leaves the weights and gradients alone; cross_entropy's loss:sum is −Σ w·lp."""
    data = [datum(seq(1), weights=[0.0] * 3 + [1.0] * 8), datum(seq(2), weights=[0.5] * 11)]
    before = trainer.forward(data, "cross_entropy").result()
    again = trainer.forward(data, "cross_entropy").result()
    # forward against forward_backward: the same sums, maybe in other kernels (tests/rounding.py)
    assert same_logprobs(lp_of(again, 0), lp_of(before, 0))
    out = trainer.forward_backward(data, "cross_entropy").result()
    assert same_logprobs(lp_of(out, 1), lp_of(before, 1))
    expected = -(np.array([0.0] * 3 + [1.0] * 8) @ lp_of(before, 0) + 0.5 * lp_of(before, 1).sum())
    assert same_metric(out.metrics["loss:sum"], expected, 8 + 0.5 * 11, logprob_gap(np.concatenate([lp_of(before, 0), lp_of(before, 1)])))  # Σ|w|
    trainer.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    after = trainer.forward(data, "cross_entropy").result()
    assert not same_logprobs(lp_of(after, 0), lp_of(before, 0))  # only optim_step changed the weights, by more than rounding


@pytest.mark.parametrize("loss_fn, config", [("importance_sampling", None), ("ppo", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}),
                                             ("cispo", None), ("dro", {"beta": 0.1}), ("gspo", None)])
def test_each_loss_matches_its_formula(fresh, loss_fn, config):
    """Each RL loss's loss:sum equals its formula evaluated on the learner's own logprobs."""
    tokens = seq(7)
    n = len(tokens) - 1
    q = np.array([0.0] * 4 + [-3.0, -2.5, -4.0, -1.0, -2.0, -3.5, -0.5], dtype=np.float64)
    adv = np.array([0.0] * 4 + [1.0, 1.0, -0.5, -0.5, 2.0, 2.0, 2.0])
    data = [datum(tokens, logprobs=q.tolist(), advantages=adv.tolist())]
    lp = lp_of(fresh.forward(data, "importance_sampling").result(), 0)
    out = fresh.forward_backward(data, loss_fn, loss_fn_config=config).result()
    assert same_logprobs(lp_of(out, 0), lp)
    r = np.exp(lp - q)
    if loss_fn == "importance_sampling":
        expected = -(r * adv).sum()
    elif loss_fn == "ppo":
        expected = -np.minimum(r * adv, np.clip(r, 0.9, 1.1) * adv).sum()
    elif loss_fn == "cispo":
        expected = -(np.clip(r, 0.8, 1.2) * lp * adv).sum()
    elif loss_fn == "dro":
        expected = -(lp * adv - 0.05 * (lp - q) ** 2).sum()
    else:
        tok = adv != 0
        s = math.exp((lp - q)[tok].mean())
        expected = -np.minimum(s * adv, np.clip(s, 1 - 3e-4, 1 + 4e-4) * adv)[tok].sum()
    assert n == len(lp)
    # lp (forward) and the loss's (forward_backward) agree within logprob_gap; each loss moves with
    # its log-probabilities by at most Σ|a|·(1 + |lp|)·max(1, r) (its ratio, clipped or not, times
    # lp for cispo's) plus dro's 0.1·Σ|lp − q|
    sensitivity = float((np.abs(adv) * (1 + np.abs(lp)) * np.maximum(1, r)).sum() + 0.1 * np.abs(lp - q).sum())
    assert same_metric(out.metrics["loss:sum"], expected, sensitivity, logprob_gap(lp))


def test_gspo_takes_its_ratio_over_the_sequence_ratio_mask(fresh):
    """The cookbook's gspo sends sequence_ratio_mask (its sampled tokens); the ratio is taken over
    it, here a mask that differs from the advantages' support (which gives another value)."""
    tokens = seq(8)
    adv = np.array([0.0] * 4 + [1.0, 1.0, 0.0, -0.5, 2.0, 0.0, 2.0])
    mask = np.array([0.0] * 3 + [1.0] * 5 + [0.0] * 3)
    lp = lp_of(fresh.forward([datum(tokens, weights=[0.0] * 11)], "cross_entropy").result(), 0)
    q = lp - np.array([0.0, 0.0, 0.0, 0.3, -0.2, 0.4, 0.1, -0.3, 0.2, 0.5, -0.1])  # the sampler's: lp - q known
    data = [datum(tokens, logprobs=q.tolist(), advantages=adv.tolist(), sequence_ratio_mask=mask.tolist())]
    out = fresh.forward_backward(data, "gspo", loss_fn_config={"clip_low_threshold": 0.5, "clip_high_threshold": 2.0}).result()
    s = math.exp(((lp - q) * mask).sum() / mask.sum())
    by_advantages = math.exp((lp - q)[adv != 0].mean())
    # lp (forward) and the loss's (forward_backward) within logprob_gap; the loss moves by s·Σ|adv|
    # through s's mean of them, and as much through each term
    assert same_metric(out.metrics["loss:sum"], -(s * adv).sum(), 2 * s * float(np.abs(adv).sum()), logprob_gap(lp))
    assert abs(s - by_advantages) > 0.05


def test_soft_targets_train_through_the_sdk(fresh):
    """Off-policy distillation's datums: [N, K] target_tokens and weights (the SDK sends them
    sparse); logprobs come back [N, K], loss:sum is -Σ w·lp; forward_backward_custom gets [N, K]
    logprobs for its loss (sdft's reverse KL) and trains on them."""
    import torch

    tokens = seq(9)
    n, k = len(tokens) - 1, 3
    targets = torch.tensor([[t, (t + 1) % 5000, (t + 7) % 5000] for t in tokens[1:]])
    weights = torch.zeros(n, k)
    weights[4:] = torch.tensor([0.7, 0.2, 0.1])  # the prompt's positions weigh 0 (sparse rows)
    soft = types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                       loss_fn_inputs={"target_tokens": types.TensorData.from_torch(targets),
                                       "weights": types.TensorData.from_torch(weights)})
    before = fresh.forward([soft], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_torch()
    assert list(before.shape) == [n, k]
    hard = lp_of(fresh.forward([datum(tokens, weights=[1.0] * n)], "cross_entropy").result(), 0)
    assert same_logprobs(before[:, 0].numpy(), hard)  # slot 0 holds the sequence's own tokens
    out = fresh.forward_backward([soft], "cross_entropy").result()
    assert same_metric(out.metrics["loss:sum"], -float((weights * before).sum()), float(weights.sum()), logprob_gap(before.numpy()))

    def reverse_kl(data, logprobs):
        assert [list(lp.shape) for lp in logprobs] == [[n, k]]
        p = torch.log_softmax(logprobs[0][4:], -1)
        return (p.exp() * (p - torch.log(weights[4:]))).sum(), {}

    fresh.forward_backward_custom([soft], reverse_kl).result()


def test_stability_info_and_provenance_spans_are_accepted(fresh):
    """The cookbook's RL data carries provenance spans and may sample with record_stability_info:
    both are taken (and not used: only stable_reinforce, refused, would read them); the loss is
    the one computed without them."""
    sampler = fresh.save_weights_and_get_sampling_client(record_stability_info=True).result()
    sample = sampler.sample(types.ModelInput.from_ints(seq(6, 5)), 1, types.SamplingParams(max_tokens=4, seed=1)).result()
    tokens = seq(6, 5) + sample.sequences[0].tokens
    plain = datum(tokens, logprobs=[0.0] * 4 + sample.sequences[0].logprobs, advantages=[0.0] * 4 + [1.0] * 4)
    spans = plain.with_provenance(
        model_input=[types.PromptProvenanceSpan(sequence_id="s0", length=5), types.SampledProvenanceSpan(sequence_id="s0", length=3)],
        loss_fn_inputs=[types.PromptProvenanceSpan(sequence_id="s0", offset=1, length=4), types.SampledProvenanceSpan(sequence_id="s0", length=4)])
    with_spans = fresh.forward([spans], "importance_sampling").result()
    without = fresh.forward([plain], "importance_sampling").result()
    assert with_spans.metrics["loss:sum"] == without.metrics["loss:sum"]  # spans unused: the same call, bit for bit


def test_unsupported_loss_is_refused_naming_the_supported_ones(fresh):
    """stable_reinforce fails the call at once with one line naming the losses served."""
    data = [datum(seq(3), logprobs=[0.0] * 11, advantages=[1.0] * 11)]
    with pytest.raises(tinker.RequestFailedError, match="importance_sampling.*ppo.*cispo.*dro"):
        fresh.forward_backward(data, "stable_reinforce").result()


def test_forward_backward_custom_runs_a_dpo_style_loss(fresh):
    """forward_backward_custom (forward, then weighted cross_entropy) trains on a client-side loss."""
    import torch

    chosen, rejected = datum(seq(11), weights=[1.0] * 11), datum(seq(12), weights=[1.0] * 11)

    def dpo(data, logprobs):
        margin = logprobs[0].sum() - logprobs[1].sum()
        loss = -torch.nn.functional.logsigmoid(0.1 * margin)
        return loss, {"margin": float(margin)}

    out = fresh.forward_backward_custom([chosen, rejected], dpo).result()
    assert "loss:sum" in out.metrics and "margin" in out.metrics
    fresh.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    again = fresh.forward_backward_custom([chosen, rejected], dpo).result()
    assert again.metrics["margin"] > out.metrics["margin"]  # the preferred sequence gained on the other


def test_sampling_seeds_stops_and_logprobs(trainer):
    """Same seed, same tokens; sampled logprobs equal the trainer's recompute (fp32, 1e-4);
    a stop token ends a sample at its first occurrence and is kept."""
    sampler = trainer.save_weights_and_get_sampling_client().result()
    prompt = types.ModelInput.from_ints(seq(5, 8))
    params = types.SamplingParams(max_tokens=12, seed=123, stop=[])
    a = sampler.sample(prompt, num_samples=3, sampling_params=params).result()
    b = sampler.sample(prompt, num_samples=3, sampling_params=params).result()
    assert [s.tokens for s in a.sequences] == [s.tokens for s in b.sequences]
    assert all(len(s.tokens) == 12 and s.stop_reason == "length" for s in a.sequences)
    first = a.sequences[0]
    full = seq(5, 8) + first.tokens
    recomputed = lp_of(trainer.forward([datum(full, weights=[0.0] * (len(full) - 1))], "cross_entropy").result(), 0)[7:]
    assert same_logprobs(first.logprobs, recomputed)  # decoding against one pass: other orders (tests/rounding.py)
    stop = first.tokens[4]
    cut = sampler.sample(prompt, num_samples=3, sampling_params=types.SamplingParams(max_tokens=12, seed=123, stop=[stop])).result()
    tokens = cut.sequences[0].tokens
    assert tokens == first.tokens[: first.tokens.index(stop) + 1] and cut.sequences[0].stop_reason == "stop"


def test_stop_strings_and_prompt_logprobs(trainer):
    """A stop string ends the sample once its text appears; prompt logprobs (NaN first, then the
    trainer's values) and top-k prompt logprobs come back when asked, compute_logprobs too."""
    sampler = trainer.save_weights_and_get_sampling_client().result()
    tokenizer = trainer.get_tokenizer()
    prompt_ids = seq(9, 10)
    prompt = types.ModelInput.from_ints(prompt_ids)
    free = sampler.sample(prompt, 1, types.SamplingParams(max_tokens=16, seed=5, stop=[])).result().sequences[0]  # same seed and shape: same draws
    text = tokenizer.decode(free.tokens)
    target = text[len(tokenizer.decode(free.tokens[:3])):][:2] or text[:2]
    stopped = sampler.sample(prompt, 1, types.SamplingParams(max_tokens=16, seed=5, stop=[target])).result().sequences[0]
    assert stopped.stop_reason == "stop" and target in tokenizer.decode(stopped.tokens)
    assert target not in tokenizer.decode(stopped.tokens[:-1])
    reply = sampler.sample(prompt, 1, types.SamplingParams(max_tokens=1), include_prompt_logprobs=True, topk_prompt_logprobs=3).result()
    assert reply.prompt_logprobs[0] is None and len(reply.prompt_logprobs) == len(prompt_ids)
    trained = lp_of(trainer.forward([datum(prompt_ids, weights=[0.0] * 9)], "cross_entropy").result(), 0)
    assert same_logprobs(reply.prompt_logprobs[1:], trained)  # the sampler's prefill against the trainer's pass
    assert len(reply.topk_prompt_logprobs[1]) == 3
    assert same_logprobs(sampler.compute_logprobs(prompt).result()[1:], reply.prompt_logprobs[1:])


def test_base_model_sampler_and_named_sampler_checkpoints(service, trainer):
    """A sampler of the base model (a KL reference) differs from the trained one; a named sampler
    checkpoint samples like the ephemeral one taken at the same weights; several live at once."""
    named = trainer.save_weights_for_sampler("snap-a").result().path
    ephemeral = trainer.save_weights_and_get_sampling_client().result()
    from_path = service.create_sampling_client(model_path=named).result()
    base = service.create_sampling_client(base_model=BASE).result()
    prompt = types.ModelInput.from_ints(seq(4, 8))
    p = types.SamplingParams(max_tokens=6, seed=9, stop=[])
    a, b, c = (s.sample(prompt, 2, p).result().sequences for s in (ephemeral, from_path, base))
    assert [x.tokens for x in a] == [x.tokens for x in b]
    assert [x.logprobs for x in a] != [x.logprobs for x in c]


def test_resume_with_and_without_optimizer_state(service, trainer):
    """A client made from save_state (with optimizer) continues exactly as the original does;
    without the optimizer state its next step differs."""
    data = [datum(seq(21), weights=[1.0] * 11), datum(seq(22), weights=[1.0] * 11)]
    adam = types.AdamParams(learning_rate=5e-3)
    trainer.forward_backward(data, "cross_entropy").result()
    trainer.optim_step(adam).result()
    path = trainer.save_state("resume-point").result().path
    resumed = service.create_training_client_from_state_with_optimizer(path).result()
    fresh_opt = service.create_training_client_from_state(path).result()
    for client in (trainer, resumed, fresh_opt):
        client.forward_backward(data, "cross_entropy").result()
        client.optim_step(adam).result()
    lps = [lp_of(c.forward(data, "cross_entropy").result(), 0) for c in (trainer, resumed, fresh_opt)]
    # the same weights, moments and data through the same kernels, one call at a time: bit for bit
    assert np.array_equal(lps[1], lps[0])
    assert not np.array_equal(lps[2], lps[0])  # without its moments the step went elsewhere
    fresh_opt.load_state_with_optimizer(path).result()  # the deprecated in-place load, weights and moments
    fresh_opt.forward_backward(data, "cross_entropy").result()
    fresh_opt.optim_step(adam).result()
    assert np.array_equal(lp_of(fresh_opt.forward(data, "cross_entropy").result(), 0), lps[0])


def test_rest_client_lists_reads_and_deletes(service, trainer):
    """The REST client sees the tenant's runs and checkpoints, weights info and samplers; deletes."""
    rest = service.create_rest_client()
    path = trainer.save_state("listed").result().path
    runs = rest.list_training_runs().result()
    assert trainer.model_id in [r.training_run_id for r in runs.training_runs]
    run = rest.get_training_run_by_tinker_path(path).result()
    assert run.base_model == BASE and run.model_owner == "alice" and run.lora_rank == 8
    listed = [c.tinker_path for c in rest.list_checkpoints(trainer.model_id).result().checkpoints]
    assert path in listed and path in [c.tinker_path for c in rest.list_user_checkpoints().result().checkpoints]
    info = rest.get_weights_info_by_tinker_path(path).result()
    assert info.base_model == BASE and info.lora_rank == 8
    rest.delete_checkpoint_from_tinker_path(path).result()
    assert path not in [c.tinker_path for c in rest.list_checkpoints(trainer.model_id).result().checkpoints]
    sampler = trainer.save_weights_and_get_sampling_client().result()
    assert rest.get_sampler(sampler._sampling_session_id).result().base_model == BASE
    session_id = trainer.model_id.split(":")[0]
    assert session_id in rest.list_sessions().result().sessions
    described = rest.get_session(session_id).result()
    assert trainer.model_id in described.training_run_ids and sampler._sampling_session_id in described.sampler_ids
    with pytest.raises(tinker.BadRequestError, match="not offered"):
        rest.publish_checkpoint_from_tinker_path(trainer.save_state("unpublished").result().path).result()


def test_a_checkpoint_past_its_ttl_is_gone_for_every_route(service, trainer):
    """save_state(ttl_seconds=...) is listed with its expiry; once it passes, the checkpoint is not
    listed, cannot be loaded or read, and its folder is deleted."""
    import time

    rest = service.create_rest_client()
    kept = trainer.save_state("kept").result().path
    short = trainer.save_state("short-lived", ttl_seconds=2).result().path
    listed = {c.tinker_path: c for c in rest.list_checkpoints(trainer.model_id).result().checkpoints}
    assert listed[short].expires_at is not None and listed[kept].expires_at is None
    assert rest.get_weights_info_by_tinker_path(short).result().lora_rank == 8
    time.sleep(2.5)
    assert short not in [c.tinker_path for c in rest.list_checkpoints(trainer.model_id).result().checkpoints]
    assert kept in [c.tinker_path for c in rest.list_user_checkpoints().result().checkpoints]
    with pytest.raises(tinker.RequestFailedError, match="no checkpoint"):
        service.create_training_client_from_state(short).result()
    with pytest.raises(tinker.NotFoundError):
        rest.get_weights_info_by_tinker_path(short).result()
    service.create_training_client_from_state(kept).result()


def test_set_checkpoint_ttl_sets_and_removes_an_expiry(service, trainer, gateway):
    """PUT …/ttl: an expiry an hour to ten years from now, or none; out of range is refused in one
    line; another tenant's checkpoint reads as missing; a TTL that passes deletes the checkpoint."""
    from datetime import datetime, timezone

    from opentinker.storage.committed import update_manifest
    from opentinker.tinker.paths import TenantCheckpoints, parse_path

    rest = service.create_rest_client()
    path = trainer.save_state("ttl-changed").result().path

    def expiry():
        return {c.tinker_path: c.expires_at for c in rest.list_checkpoints(trainer.model_id).result().checkpoints}[path]

    assert expiry() is None
    rest.set_checkpoint_ttl_from_tinker_path(path, 7200).result()
    left = (expiry() - datetime.now(timezone.utc)).total_seconds()
    assert 7000 < left <= 7200
    rest.set_checkpoint_ttl_from_tinker_path(path, None).result()
    assert expiry() is None
    for wrong in (59, 11 * 365 * 86400):
        with pytest.raises(tinker.BadRequestError, match="ttl_seconds"):
            rest.set_checkpoint_ttl_from_tinker_path(path, wrong).result()
    url, keys, sessions = gateway
    bob = tinker.ServiceClient(base_url=url, api_key=keys["bob"])
    try:
        with pytest.raises(tinker.NotFoundError):
            bob.create_rest_client().set_checkpoint_ttl_from_tinker_path(path, 7200).result()
    finally:
        bob.close("success")
    assert expiry() is None
    # an expiry already past (written as a TTL set long ago would read) removes it for every route
    update_manifest(TenantCheckpoints(sessions.storage_url("alice")).url(parse_path(path)), {"expires_at": "2000-01-01T00:00:00+00:00"})
    assert path not in [c.tinker_path for c in rest.list_checkpoints(trainer.model_id).result().checkpoints]
    with pytest.raises(tinker.NotFoundError):
        rest.set_checkpoint_ttl_from_tinker_path(path, 7200).result()


def test_deletes_leave_nothing_behind(gateway):
    """A sampler made from a checkpoint stops serving once that checkpoint is deleted (its next call
    says so, and its adapter has left the engine then); a snapshot sampler is no checkpoint and serves
    on. A run emptied while its session lives
    stays listed and its client saves and loads again; a run emptied after its session ended leaves
    the listing."""
    import time

    from opentinker.tinker.sampling import CHECK_EVERY_S

    url, keys, sessions = gateway
    service = tinker.ServiceClient(base_url=url, api_key=keys["alice"])  # a session of its own: it ends here
    rest = tinker.RestClient(base_url=url, api_key=keys["alice"])

    def listed() -> list[str]:
        return [r.training_run_id for r in rest.list_training_runs(limit=1000).result().training_runs]

    try:
        trainer = service.create_lora_training_client(base_model=BASE, rank=4, seed=2).result()
        run, session_id = trainer.model_id, trainer.model_id.split(":")[0]
        saved = [trainer.save_state("state").result().path, trainer.save_weights_for_sampler("sampler").result().path]
        from_path = service.create_sampling_client(model_path=saved[1]).result()
        snapshot = trainer.save_weights_and_get_sampling_client().result()
        prompt, params = types.ModelInput.from_ints(seq(5, 4)), types.SamplingParams(max_tokens=2)
        from_path.sample(prompt, 1, params).result()
        samplers = sessions.live[session_id][0].samplers
        (sampler_id,) = [name for name, record in samplers.records.items() if record.model_path == saved[1]]
        engine = samplers.pool.engines[samplers.records[sampler_id].loader_name]
        assert sampler_id in engine.adapters and sampler_id in engine.rollout.stream.model.peft_config
        for path in saved:
            rest.delete_checkpoint_from_tinker_path(path).result()
        deleted_at = time.monotonic()
        assert run in listed() and rest.list_checkpoints(run).result().checkpoints == []  # its session lives
        again = [trainer.save_state("again").result().path, trainer.save_weights_for_sampler("again").result().path]
        service.create_training_client_from_state(again[0]).result()
        service.create_sampling_client(model_path=again[1]).result().sample(prompt, 1, params).result()
        time.sleep(max(0.0, deleted_at + CHECK_EVERY_S - time.monotonic()))
        for _ in range(2):  # the adapter leaves the engine at the first refusal; the next one finds it gone
            with pytest.raises(tinker.RequestFailedError, match=rf"its checkpoint {saved[1]} was deleted .*serves no more"):
                from_path.sample(prompt, 1, params).result()
            assert sampler_id not in engine.adapters and sampler_id not in engine.rollout.stream.model.peft_config
            assert sampler_id not in samplers.pool.loaded[samplers.records[sampler_id].loader_name]
        assert len(snapshot.sample(prompt, 1, params).result().sequences) == 1
    finally:
        service.close("success").result()
    for path in again:  # the session has ended: once empty, its run leaves the listing
        rest.delete_checkpoint_from_tinker_path(path).result()
    assert run not in listed() and run not in rest.get_session(session_id).result().training_run_ids
    with pytest.raises(tinker.NotFoundError):
        rest.get_training_run(run).result()


def test_a_delete_is_refused_while_the_registry_does_not_answer(gateway, service, trainer, tmp_path):
    """Where a registry is configured but does not answer, a delete is refused (503: the SDK retries it
    for up to 5 minutes, so it is asked here over HTTP) and deletes nothing: whether a registered version
    uses the checkpoint is unknown. (The refusal of a checkpoint a version uses, against a real
    registry: tests/test_tinker_stack.py.)"""
    import httpx

    from opentinker.control.gateway.app import create_app
    from opentinker.control.gateway.tenants import TenantStore
    from opentinker.core.settings import Settings
    from opentinker.inference.launch import free_port
    from opentinker.inference.server import serve_in_thread
    from opentinker.tinker.local import LocalSessions

    path = trainer.save_state("registry-down").result().path
    settings = Settings(state_dir=tmp_path, host="127.0.0.1", gateway_port=free_port("127.0.0.1"), mlflow_port=free_port("127.0.0.1"))
    same_storage = LocalSessions(gateway[2].storage_root, settings.models_folder, registry_url=settings.mlflow_url)  # nothing listens there
    server = serve_in_thread(create_app(settings, tinker_sessions=same_storage), "127.0.0.1", settings.gateway_port)
    try:
        key = TenantStore(tmp_path / "tenants.json").create("alice")
        reply = httpx.delete(f"{server.url}/api/v1/training_runs/{trainer.model_id}/checkpoints/weights/registry-down",
                             headers={"X-API-Key": key}, timeout=30)
        assert reply.status_code == 503 and "was not deleted: the model registry did not answer" in reply.json()["detail"]
    finally:
        server.stop()
        same_storage.close()
    assert path in [c.tinker_path for c in service.create_rest_client().list_checkpoints(trainer.model_id).result().checkpoints]


def test_a_sampler_checkpoint_serves_like_any_jobs(gateway, trainer):
    """A save_weights_for_sampler checkpoint loads in the inference engine (what `opentinker serve`
    runs) and answers greedily what the Tinker sampler answers."""
    from opentinker.backend.rollout import SamplingParams
    from opentinker.inference.engine_hf import HFEngine
    from opentinker.tinker.paths import TenantCheckpoints, parse_path

    _, _, sessions = gateway
    path = parse_path(trainer.save_weights_for_sampler("servable").result().path)
    url = TenantCheckpoints(sessions.storage_url("alice")).url(path)
    prompt = seq(6, 8)
    greedy = trainer.save_weights_and_get_sampling_client().result().sample(
        types.ModelInput.from_ints(prompt), 1, types.SamplingParams(max_tokens=6, temperature=0.0, stop=[])).result()
    engine = HFEngine.from_checkpoint(url)
    try:
        served = engine.generate([prompt], [6], SamplingParams(max_new_tokens=6, greedy=True), stop_rule=lambda t: False).result()
    finally:
        engine.close()
    assert served[0].token_ids == greedy.sequences[0].tokens


def test_inflight_samplers_follow_their_models_newest_inflight_save(fresh):
    """kind="inflight" (save_weights_and_get_sampling_client; the POST save_weights_for_sampler
    it sends without a path): every inflight sampler of a model samples its newest inflight save (the weights saved when it was
    made, or newer: the SDK's contract), while a snapshot keeps the weights it saved."""
    prompt, params = types.ModelInput.from_ints(seq(3, 6)), types.SamplingParams(max_tokens=6, temperature=0.0)

    def greedy(sampler):
        return sampler.sample(prompt, 1, params).result().sequences[0].logprobs

    first = fresh.save_weights_and_get_sampling_client(kind="inflight").result()
    snapshot = fresh.save_weights_and_get_sampling_client().result()
    before = greedy(first)
    # samplers of the same weights decode in batches of their own: the same sums, other orders (tests/rounding.py)
    assert same_logprobs(greedy(snapshot), before)
    fresh.forward_backward([datum(seq(4), weights=[1.0] * 11)], "cross_entropy").result()
    fresh.optim_step(types.AdamParams(learning_rate=0.05)).result()
    assert same_logprobs(greedy(first), before)  # no inflight save yet: the weights it was made with
    second = fresh.save_weights_and_get_sampling_client(kind="inflight").result()
    after = greedy(second)
    assert not same_logprobs(after, before)
    assert same_logprobs(greedy(first), after)  # the earlier inflight sampler moved to the newer save
    assert same_logprobs(greedy(snapshot), before)  # the snapshot did not


def test_old_ephemeral_samplers_are_dropped(trainer):
    """Only the newest ephemeral samplers of a session are kept: the oldest is refused as missing."""
    from opentinker.tinker.sampling import MAX_SNAPSHOTS

    first = trainer.save_weights_and_get_sampling_client().result()
    prompt = types.ModelInput.from_ints(seq(2, 4))
    first.sample(prompt, 1, types.SamplingParams(max_tokens=2)).result()
    for _ in range(MAX_SNAPSHOTS):
        trainer.save_weights_and_get_sampling_client().result()
    with pytest.raises(tinker.RequestFailedError, match="newest are kept"):
        first.sample(prompt, 1, types.SamplingParams(max_tokens=2)).result()


def test_exported_adapter_downloads_through_signed_urls(gateway, trainer):
    """save_weights_external + get_external_weights_urls: each file of the peft adapter downloads
    from its URL alone (no key), loads as safetensors; a tampered link is refused."""
    import httpx
    from safetensors.torch import load

    path = trainer.save_weights_external("export").result().path
    url, keys, _ = gateway
    rest = tinker.ServiceClient(base_url=url, api_key=keys["alice"]).create_rest_client()
    links = rest.get_external_weights_urls(path).result().urls
    assert {"adapter_config.json", "adapter_model.safetensors"} <= set(links)
    weights = load(httpx.get(links["adapter_model.safetensors"]).raise_for_status().content)
    assert any("lora_A" in k for k in weights)
    assert httpx.get(links["adapter_config.json"]).json()["r"] == 8
    assert httpx.get(links["adapter_config.json"][:-3] + "abc").status_code == 404


def test_sampled_logprobs_match_the_trainer_in_bfloat16(tmp_path):
    """With the session in bfloat16 (as on a GPU), sampled logprobs agree with the trainer's
    recompute within 5e-2 (both run the same autocast; the rest is bf16 rounding of the logits)."""
    import torch

    from opentinker.backend.device import Placement
    from opentinker.control.gateway.tinker_local import local_gateway

    url, keys, sessions, server = local_gateway(tmp_path, placement=Placement(torch.device("cpu"), torch.bfloat16))
    service = tinker.ServiceClient(base_url=url, api_key=keys["alice"])
    try:
        trainer = service.create_lora_training_client(base_model=BASE, rank=4, seed=0).result()
        prompt = seq(8, 8)
        sample = trainer.save_weights_and_get_sampling_client().result().sample(
            types.ModelInput.from_ints(prompt), 2, types.SamplingParams(max_tokens=10, seed=3, stop=[])).result()
        for s in sample.sequences:
            full = prompt + s.tokens
            recomputed = lp_of(trainer.forward([datum(full, weights=[0.0] * (len(full) - 1))], "cross_entropy").result(), 0)[7:]
            assert np.abs(np.asarray(s.logprobs) - recomputed).max() < 5e-2
    finally:
        service.close("success")
        server.stop()
        sessions.close()
