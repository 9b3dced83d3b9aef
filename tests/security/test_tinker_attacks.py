"""Attacks on the gateway's Tinker API, each really attempted against a running local gateway
(sessions in this process): another tenant's ids and paths, path traversal, bad wire input, bad
calls through the SDK, missing keys and too many sessions.

Each test asserts the refusal (its status and one-line `detail`, or the SDK's error naming the
field), that it comes fast (no minutes of SDK retries: raw-protocol cases use httpx directly),
and that the victim lives on: alice's session is still live and a normal forward_backward and
sample still work after every attack. Another tenant's thing must read exactly like a missing
one: 404 with the same detail as for an id that never existed, never 403.
"""

from __future__ import annotations

import contextlib
import random
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import numpy as np
import pytest

tinker = pytest.importorskip("tinker")
zstandard = pytest.importorskip("zstandard")
from tinker import types  # noqa: E402
from tinker.proto import tinker_public_pb2 as pb  # noqa: E402

pytestmark = pytest.mark.timeout(600)
BASE, VOCAB, FAST_S = "tiny-random", 49152, 10.0
PROMPT = {"chunks": [{"type": "encoded_text", "tokens": [5, 6, 7]}]}


@pytest.fixture(scope="module")
def gw(tmp_path_factory):
    """A gateway of this module's own (alice the victim, bob the attacker, carol for the session limit)."""
    from opentinker.control.gateway.tinker_local import local_gateway

    mp = pytest.MonkeyPatch()
    mp.setenv("TINKER_TELEMETRY", "0")
    mp.setenv("OPENTINKER_STATE_DIR", "")  # local_gateway sets it; undone at the end
    root = tmp_path_factory.mktemp("tinker-attacks")
    url, keys, sessions, server = local_gateway(root, tenants=("alice", "bob", "carol"))
    yield SimpleNamespace(url=url, keys=keys, sessions=sessions, root=root)
    server.stop()
    sessions.close()
    mp.undo()


def client(gw, tenant: str | None = "bob", key: str | None = None) -> httpx.Client:
    headers = {"X-API-Key": key or gw.keys[tenant]} if tenant or key else {}
    return httpx.Client(base_url=f"{gw.url}/api/v1", headers=headers, timeout=60, trust_env=False)


@pytest.fixture(scope="module")
def alice(gw):
    """alice's session with a training client, a saved state, a saved sampler path and an ephemeral sampler."""
    service = tinker.ServiceClient(base_url=gw.url, api_key=gw.keys["alice"])
    trainer = service.create_lora_training_client(base_model=BASE, rank=4, seed=0).result()
    sampler = trainer.save_weights_and_get_sampling_client().result()
    a = SimpleNamespace(service=service, trainer=trainer, rest=tinker.RestClient(base_url=gw.url, api_key=gw.keys["alice"]), model=trainer.model_id,
                        session=trainer.model_id.split(":")[0], state=trainer.save_state("x").result().path,
                        sampler_path=trainer.save_weights_for_sampler("s").result().path, sampler=sampler,
                        sampler_id=sampler._sampling_session_id)
    yield a
    service.close("success")


@pytest.fixture(scope="module")
def bob(gw):
    service = tinker.ServiceClient(base_url=gw.url, api_key=gw.keys["bob"])
    with client(gw) as http:
        session = http.post("/create_session", json={}).json()["session_id"]
    yield SimpleNamespace(service=service, rest=tinker.RestClient(base_url=gw.url, api_key=gw.keys["bob"]), session=session)
    with client(gw) as http:
        http.post(f"/sessions/{session}/finish", json={})
    service.close("success")


@contextlib.contextmanager
def fast(limit: float = FAST_S):
    start = time.monotonic()
    yield
    assert time.monotonic() - start < limit, f"the refusal took {time.monotonic() - start:.1f} s"


def refused(response: httpx.Response, status: int, *words: str) -> str:
    assert response.status_code == status, response.text
    detail = response.json()["detail"]
    assert isinstance(detail, str) and "\n" not in detail and "Traceback" not in detail, detail
    for word in words:
        assert word in detail, detail
    return detail


def datum(tokens=None, targets=None, **inputs) -> types.Datum:
    tokens = tokens or list(range(100, 108))
    return types.Datum(model_input=types.ModelInput.from_ints(tokens),
                       loss_fn_inputs={"target_tokens": targets or [t + 1 for t in tokens], **inputs})


def still_works(gw, a) -> None:
    """alice's session is live, her training client trains and her sampler samples."""
    assert a.session in gw.sessions.live and not gw.sessions.live[a.session][0].finished
    out = a.trainer.forward_backward([datum()], "cross_entropy").result(timeout=120)
    assert np.isfinite(out.metrics["loss:sum"])
    reply = a.sampler.sample(types.ModelInput.from_ints([5, 6, 7]), 1, types.SamplingParams(max_tokens=2)).result(timeout=120)
    assert len(reply.sequences[0].tokens) >= 1


def fake(identifier: str, a) -> str:
    """The same id with a session that never existed."""
    return identifier.replace(a.session, "alice-tk-000000000000")


# --- another tenant's things read like missing ones ---------------------------------------------

REST = {"get_training_run": lambda rest, a: rest.get_training_run(a.model),
        "list_checkpoints": lambda rest, a: rest.list_checkpoints(a.model),
        "delete_checkpoint": lambda rest, a: rest.delete_checkpoint_from_tinker_path(a.state),
        "weights_info": lambda rest, a: rest.get_weights_info_by_tinker_path(a.state),
        "get_sampler": lambda rest, a: rest.get_sampler(a.sampler_id)}


@pytest.mark.parametrize("call", list(REST))
def test_bobs_rest_client_cannot_see_or_delete_alices_things(gw, alice, bob, call):
    """Bob's REST client reading, listing or deleting alice's run, checkpoint or sampler gets a 404."""
    with fast(), pytest.raises(tinker.NotFoundError) as err:
        REST[call](bob.rest, alice).result()
    assert err.value.status_code == 404
    listed = [c.tinker_path for c in alice.rest.list_checkpoints(alice.model).result().checkpoints]
    assert alice.state in listed and alice.sampler_path in listed
    still_works(gw, alice)


@pytest.mark.parametrize("make", ["sampling_client", "training_client_from_state"])
def test_bob_cannot_load_alices_checkpoints(gw, alice, bob, make):
    """Bob's create_sampling_client(alice's sampler path) / create_training_client_from_state(alice's state) is a 404."""
    with fast(), pytest.raises(tinker.NotFoundError):
        if make == "sampling_client":
            bob.service.create_sampling_client(model_path=alice.sampler_path).result()
        else:
            bob.service.create_training_client_from_state(alice.state).result()
    still_works(gw, alice)


def _alice_request_id(gw, a) -> str:
    with client(gw, "alice") as http:
        reply = http.post("/asample", json={"sampling_session_id": a.sampler_id, "prompt": PROMPT, "num_samples": 1,
                                            "sampling_params": {"max_tokens": 2}})
    assert reply.status_code == 200, reply.text
    return reply.json()["request_id"]


RAW = {  # op -> (path, body) built from alice's ids and bob's session
    "forward_backward": lambda a, b: ("/forward_backward", pb.ForwardBackwardRequest(model_id=a.model, seq_id=1, loss_fn="cross_entropy").SerializeToString()),
    "optim_step": lambda a, b: ("/optim_step", {"model_id": a.model, "seq_id": 1, "adam_params": {"learning_rate": 1.0}}),
    "save_weights": lambda a, b: ("/save_weights", {"model_id": a.model, "seq_id": 1, "path": "stolen"}),
    "get_info": lambda a, b: ("/get_info", {"model_id": a.model}),
    "asample": lambda a, b: ("/asample", {"sampling_session_id": a.sampler_id, "prompt": PROMPT, "num_samples": 1, "sampling_params": {"max_tokens": 2}}),
    "load_weights": lambda a, b: ("/load_weights", {"session_id": b.session, "model_seq_id": 0, "path": a.state, "optimizer": True}),
    "create_sampling_session": lambda a, b: ("/create_sampling_session", {"session_id": b.session, "sampling_session_seq_id": 0, "model_path": a.sampler_path}),
    "session_heartbeat": lambda a, b: ("/session_heartbeat", {"session_id": a.session}),
    "finish": lambda a, b: (f"/sessions/{a.session}/finish", {"reason": {"type": "success"}}),
    "retrieve_future": lambda a, b: ("/retrieve_future", {"request_id": a.request_id}),
}


@pytest.mark.parametrize("op", list(RAW))
def test_raw_calls_naming_alices_ids_read_like_missing_ones(gw, alice, bob, op):
    """Bob's raw calls naming alice's model, sampler, session, request or path get the 404 of an id that never existed."""
    alice.request_id = _alice_request_id(gw, alice)
    path, body = RAW[op](alice, bob)
    missing_path = fake(path, alice)
    missing_body = (pb.ForwardBackwardRequest(model_id=fake(alice.model, alice), seq_id=1).SerializeToString() if isinstance(body, bytes)
                    else {k: fake(v, alice) if isinstance(v, str) else v for k, v in body.items()})
    with client(gw) as http, fast():
        send = (lambda p, b: http.post(p, content=b, headers={"Content-Type": "application/x-protobuf"}) if isinstance(b, bytes)
                else http.post(p, json=b))
        real, missing = send(path, body), send(missing_path, missing_body)
    detail = refused(real, 404)
    assert fake(detail, alice) == refused(missing, 404)  # the same answer as for a thing that never existed
    with client(gw, "alice") as http:  # alice's own request is still hers to collect
        while (got := http.post("/retrieve_future", json={"request_id": alice.request_id})).headers["content-type"].startswith("application/json"):
            assert got.status_code == 200 and got.json().get("type") == "try_again", got.text
    still_works(gw, alice)  # among others: the finish attempt did not end alice's session


TRAVERSALS = ["tinker://../../x/weights/y", "tinker://alice-tk-000000000000:train:0/weights/..", "tinker://{model}/weights/..",
              "tinker://{model}/weights/a/b", "tinker://{model}/weights/../../../../x", "tinker://{model}/../../x/weights/y",
              "tinker://{model}/weights/%2e%2e", "tinker:///etc/passwd", "tinker://{model}/weights/.hidden"]


def _tree(root: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*") if p.is_file()}


@pytest.fixture
def canary(gw):
    """A checkpoint-like folder outside every tenant's storage, where `tinker://../../x/weights/y` would lead."""
    outside = Path(gw.sessions.storage_root) / "tenants" / "x" / "weights" / "y"
    outside.mkdir(parents=True, exist_ok=True)
    (outside / "policy.json").write_text('{"tinker": {"rank": 4242}, "canary": "outside-the-tenant"}')
    return _tree(gw.root)


@pytest.mark.parametrize("pattern", TRAVERSALS)
def test_traversal_in_tinker_paths_is_refused_as_malformed(gw, alice, canary, pattern):
    """A tinker:// path that climbs out of the tenant's storage is a 400 (malformed); nothing is read or written."""
    path = pattern.format(model=alice.model)
    attempts = [("/weights_info", {"tinker_path": path}),
                ("/load_weights", {"session_id": alice.session, "model_seq_id": 99, "path": path}),
                ("/create_sampling_session", {"session_id": alice.session, "sampling_session_seq_id": 99, "model_path": path})]
    with client(gw, "alice") as http, fast():
        for route, body in attempts:
            reply = http.post(route, json=body)
            assert any(w in refused(reply, 400) for w in ("tinker://", "checkpoint name")), reply.text
            assert "outside-the-tenant" not in reply.text and "4242" not in reply.text
    assert _tree(gw.root) == canary  # nothing outside (or inside) any tenant's storage was written
    still_works(gw, alice)


@pytest.mark.parametrize("checkpoint", ["weights/..", "weights/%2E%2E", "weights/a/b", "weights/%2E%2E/%2E%2E/%2E%2E/x",
                                        "%2E%2E/%2E%2E/x", "weights/.hidden", "sampler_weights/%2E"])
def test_traversal_in_checkpoint_ids_deletes_nothing(gw, alice, canary, checkpoint):
    """Deleting a checkpoint id that climbs out of the run's folder is a 400; no file anywhere goes away."""
    with client(gw, "alice") as http, fast():
        refused(http.delete(f"/training_runs/{alice.model}/checkpoints/{checkpoint}"), 400, "checkpoint id" if checkpoint.startswith("%") else "checkpoint name")
    assert _tree(gw.root) == canary
    still_works(gw, alice)


# --- bad input on alice's own session -------------------------------------------------------------

def _bomb(size: int) -> bytes:
    compressor = zstandard.ZstdCompressor().compressobj()
    chunk = b"\0" * 2**20
    return b"".join([*(compressor.compress(chunk) for _ in range(size // 2**20)), compressor.flush()])


def _peak_rss_since_reset() -> int | None:
    try:
        return int(next(line for line in Path("/proc/self/status").read_text().splitlines() if line.startswith("VmHWM")).split()[1]) * 1024
    except (OSError, StopIteration):
        return None


@pytest.mark.parametrize("case", ["random_bytes", "not_zstd", "bomb_70_mib", "bomb_2_gib", "over_body_limit", "wrong_encoding"])
def test_bad_forward_backward_bodies_are_refused(gw, alice, case):
    """A random, falsely-zstd, zstd-bomb, over-large or oddly-encoded forward_backward body is a 400 / 413, fast, without a memory blow-up."""
    body, headers = random.Random(0).randbytes(4096), {"Content-Type": "application/x-protobuf"}
    expect = (400, "ForwardBackwardRequest")
    if case == "not_zstd":
        headers["Content-Encoding"], expect = "zstd", (400, "not valid zstd")
    elif case.startswith("bomb"):
        body = zstandard.ZstdCompressor().compress(b"\0" * (70 * 2**20)) if case == "bomb_70_mib" else _bomb(2 * 2**30)
        headers["Content-Encoding"], expect = "zstd", (400, "inflates to more than 64 MiB")
    elif case == "over_body_limit":
        body, expect = b"\0" * (17 * 2**20), (413, "over the limit")
    elif case == "wrong_encoding":
        headers["Content-Encoding"], expect = "gzip", (400, "not supported")
    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")  # reset the peak RSS
    base = _peak_rss_since_reset()
    with client(gw, "alice") as http, fast():
        refused(http.post("/forward_backward", content=body, headers=headers), *expect)
    if base is not None and case.startswith("bomb"):
        assert _peak_rss_since_reset() - base < 200 * 2**20  # at most the 64 MiB cap was inflated, once
    still_works(gw, alice)


SDK_BAD = {  # case -> (call on alice's clients, error type, words the message must hold)
    "model_input_past_vocab": (lambda a: a.trainer.forward_backward([datum(tokens=[5, VOCAB, 7])], "cross_entropy").result(),
                               tinker.RequestFailedError, "model_input: token ids must be in [0, 49152)"),
    "targets_past_vocab": (lambda a: a.trainer.forward_backward([datum(targets=[VOCAB + 5] * 8)], "cross_entropy").result(),
                           tinker.RequestFailedError, "target_tokens: token ids must be in [0, 49152)"),
    "targets_length": (lambda a: a.trainer.forward_backward([datum(targets=[1, 2, 3])], "cross_entropy").result(),
                       tinker.RequestFailedError, "target_tokens"),
    "nan_advantages": (lambda a: a.trainer.forward_backward([datum(logprobs=[0.0] * 8, advantages=[float("nan")] * 8)],
                                                            "importance_sampling").result(), tinker.RequestFailedError, "advantages"),
    "nan_weights": (lambda a: a.trainer.forward_backward([datum(weights=[float("nan")] * 8)], "cross_entropy").result(),
                    tinker.RequestFailedError, "weights"),
    "unknown_loss": (lambda a: a.trainer.forward_backward([datum()], "no_such_loss").result(), tinker.RequestFailedError, "no_such_loss"),
    "unknown_loss_config_key": (lambda a: a.trainer.forward_backward([datum(logprobs=[0.0] * 8, advantages=[1.0] * 8)], "ppo",
                                                                     loss_fn_config={"no_such_key": 1.0}).result(),
                                tinker.RequestFailedError, "no_such_key"),
    "unknown_base_model": (lambda a: a.service.create_lora_training_client(base_model="no-such/model", rank=4).result(),
                           tinker.BadRequestError, "served: "),
    "prompt_past_vocab": (lambda a: a.sampler.sample(types.ModelInput.from_ints([5, VOCAB]), 1, types.SamplingParams(max_tokens=2)).result(),
                          tinker.RequestFailedError, "prompt: token ids must be in [0, 49152)"),
    "zero_samples": (lambda a: a.sampler.sample(types.ModelInput.from_ints([5, 6]), 0, types.SamplingParams(max_tokens=2)).result(),
                     tinker.BadRequestError, "num_samples"),
    "zero_max_tokens": (lambda a: a.sampler.sample(types.ModelInput.from_ints([5, 6]), 1, types.SamplingParams(max_tokens=0)).result(),
                        tinker.BadRequestError, "max_tokens"),
    "image_chunk": (lambda a: a.sampler.sample(types.ModelInput(chunks=[types.ImageChunk(data=b"\x89PNG....", format="png", expected_tokens=4)]),
                                               1, types.SamplingParams(max_tokens=2)).result(), tinker.BadRequestError, "image"),
}


@pytest.mark.parametrize("case", list(SDK_BAD))
def test_bad_calls_through_the_sdk_fail_once_and_clearly(gw, alice, case):
    """Out-of-vocabulary ids, mismatched or NaN loss inputs, unknown losses, keys or models, empty samples, image chunks: one clear error."""
    call, error, words = SDK_BAD[case]
    with fast(), pytest.raises(error) as err:
        call(alice)
    assert words in str(err.value), str(err.value)
    assert "Traceback" not in str(err.value)
    if case == "unknown_base_model":
        assert BASE in str(err.value)
    still_works(gw, alice)


# --- authentication and limits ----------------------------------------------------------------

ROUTES = [("POST", "/client/config"), ("POST", "/client/dynamic_config"), ("POST", "/telemetry"), ("GET", "/get_server_capabilities"),
          ("POST", "/create_session"), ("POST", "/session_heartbeat"), ("POST", "/sessions/alice-tk-000000000000/finish"),
          *[("POST", f"/{op}") for op in ("create_model", "forward_backward", "optim_step", "save_weights", "save_weights_for_sampler",
                                          "load_weights", "asample", "retrieve_future", "get_info", "create_sampling_session", "weights_info")],
          ("GET", "/samplers/alice-tk-000000000000:sample:0"), ("GET", "/training_runs"), ("GET", "/training_runs/alice-tk-000000000000:train:0"),
          ("GET", "/training_runs/alice-tk-000000000000:train:0/checkpoints"), ("GET", "/checkpoints"),
          ("DELETE", "/training_runs/alice-tk-000000000000:train:0/checkpoints/weights/x")]


@pytest.mark.parametrize("key", [None, "wrong-key", "", "Bearer {alice}", "{alice}x"])
def test_every_tinker_route_wants_a_valid_api_key(gw, alice, key):
    """A missing, empty, wrong or mangled X-API-Key is a 401 on every Tinker route, naming X-API-Key."""
    headers = {} if key is None else {"X-API-Key": key.format(alice=gw.keys["alice"])}
    with httpx.Client(base_url=f"{gw.url}/api/v1", headers=headers, timeout=30, trust_env=False) as http, fast():
        for method, route in ROUTES:
            refused(http.request(method, route, json={"session_id": alice.session, "model_id": alice.model}), 401, "X-API-Key")
    still_works(gw, alice)


def test_more_live_sessions_than_the_limit_are_refused(gw, alice):
    """A tenant opening sessions past the limit gets a 400 naming the limit; finishing one frees a place."""
    opened = []
    with client(gw, "carol") as http, fast(30):
        for _ in range(gw.sessions.max_sessions + 2):
            reply = http.post("/create_session", json={"tags": [], "user_metadata": {}})
            if reply.status_code != 200:
                break
            opened.append(reply.json()["session_id"])
        try:
            assert len(opened) == gw.sessions.max_sessions
            refused(reply, 400, f"the limit is {gw.sessions.max_sessions}")
            assert http.post(f"/sessions/{opened.pop()}/finish", json={}).status_code == 200
            opened.append(http.post("/create_session", json={}).json()["session_id"])
        finally:
            for session in opened:
                http.post(f"/sessions/{session}/finish", json={})
    assert not [s for s in gw.sessions.live if s.startswith("carol-")]
    still_works(gw, alice)
