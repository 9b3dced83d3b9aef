"""Two tenants' Tinker sessions on one base (issue 27), through the unmodified SDK: the gateway's
sessions share each base model (LocalSessions(shared_bases=True), what a base-model worker runs),
every training client is an adapter of it, and a tenant's results are the same whether the other
tenant's calls share its pass or not. Checkpoints, samplers and a session's end work as before.
(The gateway confines ids to their tenant before any of this: tests/security/test_tinker_attacks.py.)"""

from __future__ import annotations

import numpy as np
import pytest

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402

from tests.rounding import logprob_gap, same_logprobs, same_metric  # noqa: E402

BASE = "tiny-random"


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    from opentinker.control.gateway.tinker_local import local_gateway

    mp = pytest.MonkeyPatch()
    mp.setenv("TINKER_TELEMETRY", "0")
    url, keys, sessions, server = local_gateway(tmp_path_factory.mktemp("shared"), tenants=("alice", "bob"), shared_bases=True)
    clients = {name: tinker.ServiceClient(base_url=url, api_key=key) for name, key in keys.items()}
    yield clients, sessions
    for client in clients.values():
        client.close("success")
    server.stop()
    sessions.close()
    mp.undo()


def datum(tokens: list[int], **inputs) -> types.Datum:
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs={"target_tokens": tokens[1:], **inputs})


def seq(start: int, n: int = 12) -> list[int]:
    return [(start * 37 + 11 * i) % 5000 + 100 for i in range(n)]


ALICE = [datum(seq(1), weights=[0.0] * 3 + [1.0] * 8), datum(seq(2, 7), weights=[0.5] * 6)]
BOB = [datum(seq(5), logprobs=[-2.0] * 11, advantages=[0.0] * 4 + [1.0] * 7)]


def lps(out) -> list[np.ndarray]:
    return [np.asarray(o["logprobs"].tolist()) for o in out.loss_fn_outputs]


def test_two_tenants_train_on_one_base_and_each_gets_its_own_results(shared):
    clients, sessions = shared
    alone = clients["alice"].create_lora_training_client(base_model=BASE, rank=4, seed=1).result()
    want = alone.forward_backward(ALICE, "cross_entropy").result()  # nothing else in flight
    (base,) = sessions.bases.bases.values()
    passes = base.stats.passes
    alice = clients["alice"].create_lora_training_client(base_model=BASE, rank=4, seed=1).result()
    bob = clients["bob"].create_lora_training_client(base_model=BASE, rank=8, seed=2, train_unembed=False).result()
    assert len(sessions.bases.bases) == 1 and len(sessions.bases.adapters()["tiny-random"]) == 3  # one base, three clients
    # the two calls below travel separately: give them a second to meet in one pass (joint, as a GPU's passes are; a CPU takes turns)
    base.gather_s, window, base.joint_updates = 1.0, base.gather_s, True
    try:
        futures = alice.forward_backward(ALICE, "cross_entropy"), bob.forward_backward(BOB, "importance_sampling")
        got, bobs = (f.result() for f in futures)
    finally:
        base.gather_s, base.joint_updates = window, False
    assert base.stats.passes == passes + 1 and base.stats.shared >= 1  # both tenants' rows went through one pass
    # sharing a pass or alone: the same sums in other orders (tests/rounding.py); the loss moves by Σ|w| = 11 times the gap
    assert same_metric(got.metrics["loss:sum"], want.metrics["loss:sum"], 11.0, logprob_gap(np.concatenate(lps(want))))
    assert all(same_logprobs(a, b) for a, b in zip(lps(got), lps(want)))
    assert bobs.metrics["loss:sum"] != 0.0
    # the rest of a client's life as on a base of its own: a step, a sampler, a checkpoint, a resume
    alice.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    sampler = alice.save_weights_and_get_sampling_client()
    import torch

    torch.manual_seed(123)
    stream = torch.get_rng_state()  # what other tenants' unseeded samples draw from
    sample = sampler.sample(types.ModelInput.from_ints(seq(3, 6)), 1, types.SamplingParams(max_tokens=4, seed=0)).result()
    assert len(sample.sequences[0].tokens) == 4
    assert torch.equal(torch.get_rng_state(), stream)  # alice's seed drew from a generator of its own, nobody's stream reseeded
    bobs_sampler = bob.save_weights_and_get_sampling_client()
    assert len(bobs_sampler.sample(types.ModelInput.from_ints(seq(4, 6)), 2, types.SamplingParams(max_tokens=3)).result().sequences) == 2
    (engine,) = sessions.bases.engines.engines.values()  # both tenants' samplers are adapters of one sampling engine
    assert len(engine.adapters) == 2
    path = alice.save_state("after-one").result().path
    import fsspec

    from opentinker.tinker.paths import parse_path

    session = sessions.live[alice.model_id.split(":")[0]][0]
    with fsspec.open(session.store.url(parse_path(path)) + "/rng.json") as f:
        assert f.read() == b"{}"  # the process's generators are both tenants' streams: not in alice's files
    resumed = clients["alice"].create_training_client_from_state_with_optimizer(path).result()
    after, again = (c.forward(ALICE, "cross_entropy").result() for c in (alice, resumed))
    assert all(same_logprobs(a, b) for a, b in zip(lps(after), lps(again)))
    assert not same_logprobs(lps(after)[0], lps(want)[0])  # the step changed alice's adapter, by more than rounding


def test_a_session_that_ends_takes_only_its_own_adapters_off_the_base(shared):
    clients, sessions = shared
    alice = clients["alice"].create_lora_training_client(base_model=BASE, rank=4, seed=3).result()
    alice.save_weights_and_get_sampling_client().result()
    bob_session = [s for s in sessions.live if s.startswith("bob-")]
    # Alice's adapter and sampler sit on the base bob's session uses: his session still cannot name them.
    from opentinker.tinker.paths import NotFound

    alices = sessions.live[alice.model_id.split(":")[0]][0]
    bobs = sessions.live[bob_session[0]][0]
    for op, body in (("optim_step", {"model_id": alice.model_id, "seq_id": 1, "adam_params": {"learning_rate": 1.0}}),
                     ("save_weights", {"model_id": alice.model_id, "seq_id": 2, "path": "stolen"})):
        with pytest.raises(NotFound, match="no model"):
            bobs.submit(op, body)
    for sampler_id in alices.samplers.records:
        with pytest.raises(NotFound, match="no sampler"):
            bobs.get_sampler(sampler_id)
    before = sessions.bases.adapters()["tiny-random"]
    for session_id in bob_session:
        sessions.end(session_id, "test")
    left = sessions.bases.adapters()["tiny-random"]
    assert left and all(not m.startswith("bob-") for m in left) and set(left) <= set(before)
    assert alice.forward(ALICE, "cross_entropy").result().metrics["loss:sum"] != 0.0


def test_a_worker_door_opens_only_to_its_own_sessions_token(tmp_path):
    """On a base-model worker every session has a door under the worker's server: another
    session's token is refused (401) at it, a session the worker does not host is a 404 the
    gateway reads as gone."""
    from starlette.testclient import TestClient

    from opentinker.orchestration.base_worker import SessionRouter
    from opentinker.tinker.server import create_app
    from opentinker.tinker.session import TinkerSession

    router = SessionRouter()
    for name in ("alice-tk-1", "bob-tk-2"):
        session = TinkerSession(name, name.split("-")[0], f"file://{tmp_path}/{name}", tmp_path / "models")
        router.apps[name] = create_app(session, f"token-of-{name}")
    http = TestClient(router)

    def describe(door: str, token: str):
        return http.post(f"/s/{door}/direct/describe", json={}, headers={"Authorization": f"Bearer {token}"})

    assert describe("alice-tk-1", "token-of-alice-tk-1").status_code == 200
    assert describe("alice-tk-1", "token-of-bob-tk-2").status_code == 401  # bob's session token at alice's door
    assert describe("alice-tk-1", "").status_code == 401
    gone = describe("carol-tk-3", "token-of-bob-tk-2")
    assert gone.status_code == 404 and gone.headers["x-opentinker-no-session"] == "1"
    assert describe("../s/alice-tk-1", "token-of-bob-tk-2").status_code in (401, 404)  # no way round by path
