"""Attacks on the gateway's Tinker API, each really attempted against a running local gateway (sessions
in this process): another tenant's ids and paths, path traversal, bad wire input, bad calls through the
SDK, missing keys, too many sessions. Each test asserts the refusal (status and one-line `detail`, or the
SDK's error naming the field), that it comes fast (raw-protocol cases use httpx, so no SDK retries hide a
5xx), and that the victim lives on: alice's session is live and a forward_backward and a sample still
work after every attack. Another tenant's thing reads exactly like one that never existed (404, never 403).
"""

from __future__ import annotations

import contextlib
import json
import random
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import numpy as np
import pytest

tinker = pytest.importorskip("tinker")
zstandard = pytest.importorskip("zstandard")
from tinker import types
from tinker.proto import tinker_public_pb2 as pb

pytestmark = pytest.mark.timeout(600)
BASE, VOCAB, NOBODY = "tiny-random", 49152, "alice-tk-000000000000"
PROMPT = {"chunks": [{"type": "encoded_text", "tokens": [5, 6, 7]}]}


@pytest.fixture(scope="module")
def gw(tmp_path_factory):
    """A gateway of this module's own: alice the victim, bob the attacker, carol for the session limit."""
    from opentinker.control.gateway.tinker_local import local_gateway

    mp = pytest.MonkeyPatch()
    for name, value in (("TINKER_TELEMETRY", "0"), ("OPENTINKER_STATE_DIR", "")):  # local_gateway sets the latter; undone at the end
        mp.setenv(name, value)
    root = tmp_path_factory.mktemp("tinker-attacks")
    url, keys, sessions, server = local_gateway(root, tenants=("alice", "bob", "carol"))
    yield SimpleNamespace(url=url, keys=keys, sessions=sessions, root=root)
    server.stop()
    sessions.close()
    mp.undo()


def client(gw, tenant: str = "bob", headers: dict | None = None) -> httpx.Client:
    headers = {"X-API-Key": gw.keys[tenant]} if headers is None else headers
    return httpx.Client(base_url=f"{gw.url}/api/v1", headers=headers, timeout=60, trust_env=False)


@pytest.fixture(scope="module")
def alice(gw):
    """alice's session: a training client, a saved state, a saved sampler path, an ephemeral sampler."""
    service = tinker.ServiceClient(base_url=gw.url, api_key=gw.keys["alice"])
    trainer = service.create_lora_training_client(base_model=BASE, rank=4, seed=0).result()
    sampler = trainer.save_weights_and_get_sampling_client().result()
    yield SimpleNamespace(service=service, trainer=trainer, rest=tinker.RestClient(base_url=gw.url, api_key=gw.keys["alice"]),
                          model=trainer.model_id, session=trainer.model_id.split(":")[0], state=trainer.save_state("x").result().path,
                          sampler_path=trainer.save_weights_for_sampler("s").result().path, sampler=sampler,
                          sampler_id=sampler._sampling_session_id)
    service.close("success")


@pytest.fixture(scope="module")
def bob(gw):
    service = tinker.ServiceClient(base_url=gw.url, api_key=gw.keys["bob"])
    with client(gw) as http:  # a session of bob's own, for the raw calls
        session = http.post("/create_session", json={}).json()["session_id"]
        yield SimpleNamespace(service=service, rest=tinker.RestClient(base_url=gw.url, api_key=gw.keys["bob"]), session=session)
        http.post(f"/sessions/{session}/finish", json={})
    service.close("success")


@contextlib.contextmanager
def fast(limit: float = 10.0):
    start = time.monotonic()
    yield
    assert time.monotonic() - start < limit, f"the refusal took {time.monotonic() - start:.1f} s"


def refused(response: httpx.Response, status: int, *words: str) -> str:
    assert response.status_code == status, response.text
    detail = response.json()["detail"]
    assert isinstance(detail, str) and "\n" not in detail and "Traceback" not in detail, detail
    assert all(word in detail for word in words), detail
    return detail


def datum(tokens=tuple(range(100, 108)), targets=None, **inputs) -> types.Datum:
    return types.Datum(model_input=types.ModelInput.from_ints(list(tokens)),
                       loss_fn_inputs={"target_tokens": targets or [t + 1 for t in tokens], **inputs})


def collect(http: httpx.Client, request_id: str) -> httpx.Response:  # a future's result, polled while it runs
    while (got := http.post("/retrieve_future", json={"request_id": request_id})).status_code == 408 or \
            got.headers["content-type"].startswith("application/json") and got.json().get("type") == "try_again":
        pass
    return got


def still_works(gw, a) -> None:  # alice's session is live, her training client trains and her sampler samples
    assert a.session in gw.sessions.live and not gw.sessions.live[a.session][0].finished
    assert np.isfinite(a.trainer.forward_backward([datum()], "cross_entropy").result(timeout=120).metrics["loss:sum"])
    assert a.sampler.sample(types.ModelInput.from_ints([5, 6, 7]), 1, types.SamplingParams(max_tokens=2)).result(timeout=120).sequences


# --- another tenant's things read like missing ones -------------------------------------------------

BOB_SDK = {"get_training_run": lambda bob, a: bob.rest.get_training_run(a.model),
           "list_checkpoints": lambda bob, a: bob.rest.list_checkpoints(a.model),
           "delete_checkpoint": lambda bob, a: bob.rest.delete_checkpoint_from_tinker_path(a.state),
           "weights_info": lambda bob, a: bob.rest.get_weights_info_by_tinker_path(a.state),
           "get_sampler": lambda bob, a: bob.rest.get_sampler(a.sampler_id),
           "sampling_client_from_path": lambda bob, a: bob.service.create_sampling_client(model_path=a.sampler_path),
           "training_client_from_state": lambda bob, a: bob.service.create_training_client_from_state(a.state)}


@pytest.mark.parametrize("call", list(BOB_SDK))
def test_bobs_sdk_cannot_see_load_or_delete_alices_things(gw, alice, bob, call):
    """Bob's SDK reading, listing, deleting or loading alice's run, checkpoint or sampler gets a 404, never a 403."""
    with fast(), pytest.raises(tinker.NotFoundError, match="404|[Nn]o "):
        BOB_SDK[call](bob, alice).result()
    listed = [c.tinker_path for c in alice.rest.list_checkpoints(alice.model).result().checkpoints]
    assert alice.state in listed and alice.sampler_path in listed
    still_works(gw, alice)


RAW = {  # op -> (route, body) from alice's ids and bob's own session
    "forward_backward": lambda a, b: ("/forward_backward", pb.ForwardBackwardRequest(model_id=a.model, seq_id=1).SerializeToString()),
    "optim_step": lambda a, b: ("/optim_step", {"model_id": a.model, "seq_id": 1, "adam_params": {"learning_rate": 1.0}}),
    "save_weights": lambda a, b: ("/save_weights", {"model_id": a.model, "seq_id": 1, "path": "stolen"}),
    "get_info": lambda a, b: ("/get_info", {"model_id": a.model}),
    "asample": lambda a, b: ("/asample", {"sampling_session_id": a.sampler_id, "prompt": PROMPT, "sampling_params": {"max_tokens": 2}}),
    "load_weights": lambda a, b: ("/load_weights", {"session_id": b.session, "model_seq_id": 0, "path": a.state, "optimizer": True}),
    "create_sampling_session": lambda a, b: ("/create_sampling_session", {"session_id": b.session, "model_path": a.sampler_path}),
    "session_heartbeat": lambda a, b: ("/session_heartbeat", {"session_id": a.session}),
    "finish": lambda a, b: (f"/sessions/{a.session}/finish", {"reason": {"type": "success"}}),
    "retrieve_future": lambda a, b: ("/retrieve_future", {"request_id": a.request_id}),
}


@pytest.mark.parametrize("op", list(RAW))
def test_raw_calls_naming_alices_ids_read_like_missing_ones(gw, alice, bob, op):
    """Bob's raw calls naming alice's model, sampler, session, request or path get the 404 of an id that never existed."""
    with client(gw, "alice") as http:  # a real request id of alice's
        alice.request_id = http.post("/asample", json=RAW["asample"](alice, bob)[1]).json()["request_id"]
    route, body = RAW[op](alice, bob)
    fake = lambda text: text.replace(alice.session, NOBODY)  # the same id, of a session that never existed
    with client(gw) as http, fast():
        if isinstance(body, bytes):
            send = lambda r, b: http.post(r, content=b, headers={"Content-Type": "application/x-protobuf"})
            real, missing = send(route, body), send(route, pb.ForwardBackwardRequest(model_id=fake(alice.model), seq_id=1).SerializeToString())
        else:
            real, missing = http.post(route, json=body), http.post(fake(route), json={k: fake(v) if isinstance(v, str) else v for k, v in body.items()})
    assert fake(refused(real, 404)) == refused(missing, 404)  # the same answer as for a thing that never existed
    with client(gw, "alice") as http:  # alice's own request is still hers to collect
        assert (got := collect(http, alice.request_id)).headers["content-type"].startswith("application/x-protobuf"), got.text
    still_works(gw, alice)  # among others: bob's finish did not end alice's session


def _tree(root: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*") if p.is_file()}


@pytest.fixture
def canary(gw):
    """A checkpoint-like folder outside every tenant's storage, where `tinker://../../x/weights/y` would lead; the tree before."""
    outside = Path(gw.sessions.storage_root) / "tenants" / "x" / "weights" / "y"
    outside.mkdir(parents=True, exist_ok=True)
    (outside / "policy.json").write_text('{"tinker": {"rank": 4242}, "canary": "outside-the-tenant"}')
    return _tree(gw.root)


@pytest.mark.parametrize("pattern", ["tinker://../../x/weights/y", f"tinker://{NOBODY}:train:0/weights/..", "tinker://{model}/weights/..",
                                     "tinker://{model}/weights/a/b", "tinker://{model}/weights/../../../../x", "tinker:///etc/passwd",
                                     "tinker://{model}/../../x/weights/y", "tinker://{model}/weights/%2e%2e", "tinker://{model}/weights/.hidden"])
def test_traversal_in_tinker_paths_is_refused_as_malformed(gw, alice, canary, pattern):
    """A tinker:// path that climbs out of the tenant's storage is a 400 (malformed); nothing is read or written."""
    path = pattern.format(model=alice.model)
    attempts = [("/weights_info", {"tinker_path": path}), ("/load_weights", {"session_id": alice.session, "model_seq_id": 99, "path": path}),
                ("/create_sampling_session", {"session_id": alice.session, "sampling_session_seq_id": 99, "model_path": path})]
    with client(gw, "alice") as http, fast():
        for route, body in attempts:
            reply = http.post(route, json=body)
            assert any(w in refused(reply, 400) for w in ("tinker://", "checkpoint name")), reply.text
            assert "outside-the-tenant" not in reply.text and "4242" not in reply.text
    assert _tree(gw.root) == canary  # nothing outside (or inside) any tenant's storage was written
    still_works(gw, alice)


@pytest.mark.parametrize("checkpoint", ["weights/%2E%2E", "weights/a/b", "weights/%2E%2E/%2E%2E/%2E%2E/x", "%2E%2E/%2E%2E/x",
                                        "weights/.hidden", "sampler_weights/%2E"])
def test_traversal_in_checkpoint_ids_deletes_nothing(gw, alice, canary, checkpoint):
    """Deleting a checkpoint id that climbs out of the run's folder is a 400; no file anywhere goes away."""
    with client(gw, "alice") as http, fast():
        refused(http.delete(f"/training_runs/{alice.model}/checkpoints/{checkpoint}"), 400, "checkpoint id" if checkpoint[0] == "%" else "checkpoint name")
    assert _tree(gw.root) == canary
    still_works(gw, alice)


# --- bad input on alice's own session -----------------------------------------------------------------

def _bomb(mib: int) -> bytes:  # streamed: the inflated size is never held here
    compressor, chunk = zstandard.ZstdCompressor().compressobj(), b"\0" * 2**20
    return b"".join([*(compressor.compress(chunk) for _ in range(mib)), compressor.flush()])


ZSTD, NOISE = {"Content-Encoding": "zstd"}, random.Random(0).randbytes(4096)
BODIES = {  # case -> (body, extra headers, status, words in the detail)
    "random_bytes": (lambda: NOISE, {}, 400, "not a ForwardBackwardRequest"),
    "not_zstd": (lambda: NOISE, ZSTD, 400, "not valid zstd"),
    "bomb_70_mib": (lambda: zstandard.ZstdCompressor().compress(b"\0" * (70 * 2**20)), ZSTD, 400, "inflates to more than 64 MiB"),
    "bomb_2_gib": (lambda: _bomb(2048), ZSTD, 400, "inflates to more than 64 MiB"),
    "gzip": (lambda: NOISE, {"Content-Encoding": "gzip"}, 400, "not supported"),
    "over_body_limit": (lambda: b"\0" * (17 * 2**20), {}, 413, "over the limit"),
}


@pytest.mark.parametrize("case", list(BODIES))
def test_bad_forward_backward_bodies_are_refused(gw, alice, case):
    """A random, falsely-zstd, zstd-bomb, gzip or over-large forward_backward body is a 400 / 413, fast, with no memory blow-up."""
    make, headers, status, words = BODIES[case]
    body = make()  # built before the peak is reset
    peak = lambda: int(next(ln for ln in Path("/proc/self/status").read_text().splitlines() if ln.startswith("VmHWM")).split()[1]) * 1024
    Path("/proc/self/clear_refs").write_text("5")  # reset the peak RSS (VmHWM)
    base = peak()
    with client(gw, "alice") as http, fast():
        refused(http.post("/forward_backward", content=body, headers={"Content-Type": "application/x-protobuf", **headers}), status, words)
    assert peak() - base < 200 * 2**20  # a bomb inflates at most up to the 64 MiB cap, once
    still_works(gw, alice)


def fb(loss="cross_entropy", config=None, **kw):
    return lambda a: a.trainer.forward_backward([datum(**kw)], loss, loss_fn_config=config).result()


def sample(prompt, n=1, max_tokens=2):
    return lambda a: a.sampler.sample(types.ModelInput.from_ints(prompt), n, types.SamplingParams(max_tokens=max_tokens)).result()


RL, Failed, Bad = {"logprobs": [0.0] * 8, "advantages": [1.0] * 8}, tinker.RequestFailedError, tinker.BadRequestError
IMAGE = types.ModelInput(chunks=[types.ImageChunk(data=b"\x89PNG....", format="png", expected_tokens=4)])
SDK_BAD = {  # case -> (call on alice's clients, error type, words the message must hold)
    "model_input_past_vocab": (fb(tokens=[5, VOCAB, 7]), Failed, "model_input: token ids must be in [0, 49152)"),
    "targets_past_vocab": (fb(targets=[VOCAB + 5] * 8), Failed, "target_tokens: token ids must be in [0, 49152)"),
    "targets_length": (fb(targets=[1, 2, 3]), Failed, "target_tokens"),
    "nan_advantages": (fb("importance_sampling", logprobs=[0.0] * 8, advantages=[float("nan")] * 8), Failed, "advantages"),
    "nan_weights": (fb(weights=[float("nan")] * 8), Failed, "weights"),
    "unknown_loss": (fb("no_such_loss"), Failed, "no_such_loss"),
    "unknown_loss_config_key": (fb("ppo", {"no_such_key": 1.0}, **RL), Failed, "no_such_key"),
    "unknown_base_model": (lambda a: a.service.create_lora_training_client(base_model="no-such/model", rank=4).result(), Bad, "served: "),
    "prompt_past_vocab": (sample([5, VOCAB]), Failed, "prompt: token ids must be in [0, 49152)"),
    "zero_samples": (sample([5, 6], n=0), Bad, "num_samples"),
    "zero_max_tokens": (sample([5, 6], max_tokens=0), Bad, "max_tokens"),
    "image_chunk": (lambda a: a.sampler.sample(IMAGE, 1, types.SamplingParams(max_tokens=2)).result(), Bad, "image"),
}


@pytest.mark.parametrize("case", list(SDK_BAD))
def test_bad_calls_through_the_sdk_fail_once_and_clearly(gw, alice, case):
    """Out-of-vocabulary ids, mismatched or NaN loss inputs, unknown losses, keys or models, empty samples, image chunks: one clear error."""
    call, error, words = SDK_BAD[case]
    with fast(), pytest.raises(error) as err:
        call(alice)
    assert words in str(err.value) and "Traceback" not in str(err.value), str(err.value)
    assert case != "unknown_base_model" or BASE in str(err.value)  # the message lists the served models
    still_works(gw, alice)


def _sparse_huge_shape(a) -> bytes:  # target_tokens: no values in a sparse tensor of shape [1, 2**40] (8 TiB dense)
    targets = pb.Tensor(dtype=pb.DTYPE_INT64, shape=[1, 2**40], sparse_csr=pb.SparseCsr(crow_indices=np.zeros(2, np.int64).tobytes()))
    one = pb.Datum(model_input=[pb.Chunk(encoded_text=pb.EncodedTextChunk(tokens=np.array([5, 6, 7], "<i4").tobytes()))],
                   loss_fn_inputs={"target_tokens": targets})
    return pb.ForwardBackwardRequest(model_id=a.model, seq_id=0, loss_fn="cross_entropy", data=[one]).SerializeToString()


def jbody(route: str, **body):
    return route, json.dumps(body).replace('"INF"', "1e400")  # 1e400: valid JSON, read as a float out of range


MALFORMED = [  # (case, route and body from alice's ids, the bug if one is known; the five found were fixed)
    ("seq_id_not_a_number", lambda a: jbody("/optim_step", model_id=a.model, seq_id="x", adam_params={}), None),
    ("save_name_not_a_string", lambda a: jbody("/save_weights", model_id=a.model, seq_id=0, path={"a": 1}), None),
    ("number_out_of_float_range", lambda a: jbody("/asample", sampling_session_id=a.sampler_id, prompt=PROMPT, num_samples="INF"), None),
    ("sampling_params_not_an_object", lambda a: jbody("/asample", sampling_session_id=a.sampler_id, prompt=PROMPT, sampling_params=[1]), None),
    ("adam_params_not_an_object", lambda a: jbody("/optim_step", model_id=a.model, seq_id=0, adam_params=[1]), None),
    ("lora_config_not_an_object", lambda a: jbody("/create_model", session_id=a.session, model_seq_id=77, base_model=BASE, lora_config=[1]), None),
    ("sparse_tensor_of_huge_shape", lambda a: ("/forward_backward", _sparse_huge_shape(a)), None),
]


@pytest.mark.parametrize("make", [pytest.param(make, id=case, marks=pytest.mark.xfail(strict=True, reason=why) if why else ()) for case, make, why in MALFORMED])
def test_ill_typed_fields_are_a_client_error_never_a_server_error(gw, alice, make):
    """A field of the wrong type or range in a raw call is a 400 or a 'user' failed future, never a 5xx or a 'server' failure."""
    route, body = make(alice)
    with client(gw, "alice") as http, fast():
        reply = http.post(route, content=body, headers={"Content-Type": "application/x-protobuf" if isinstance(body, bytes) else "application/json"})
        assert reply.status_code in (200, 400), reply.text
        if reply.status_code == 400:
            refused(reply, 400)
        else:
            assert (got := collect(http, reply.json()["request_id"]).json()).get("category") == "user", got
    still_works(gw, alice)


# --- authentication and limits ------------------------------------------------------------------------

ROUTES = [*[("POST", f"/{op}") for op in ("client/config", "client/dynamic_config", "telemetry", "create_session", "session_heartbeat",
                                          f"sessions/{NOBODY}/finish", "create_model", "forward_backward", "optim_step", "save_weights",
                                          "save_weights_for_sampler", "load_weights", "asample", "retrieve_future", "get_info",
                                          "create_sampling_session", "weights_info")],
          *[("GET", f"/{path}") for path in ("get_server_capabilities", f"samplers/{NOBODY}:sample:0", "training_runs", "checkpoints",
                                             f"training_runs/{NOBODY}:train:0", f"training_runs/{NOBODY}:train:0/checkpoints")],
          ("DELETE", f"/training_runs/{NOBODY}:train:0/checkpoints/weights/x")]


@pytest.mark.parametrize("key", [None, "wrong-key", "", "Bearer {alice}", "{alice}x"])
def test_every_tinker_route_wants_a_valid_api_key(gw, alice, key):
    """A missing, empty, wrong or mangled X-API-Key is a 401 on every Tinker route, naming X-API-Key."""
    headers = {} if key is None else {"X-API-Key": key.format(alice=gw.keys["alice"])}
    with client(gw, headers=headers) as http, fast():
        for method, route in ROUTES:
            refused(http.request(method, route, json={"session_id": alice.session, "model_id": alice.model}), 401, "X-API-Key")
    still_works(gw, alice)


def test_more_live_sessions_than_the_limit_are_refused(gw, alice):
    """A tenant opening sessions past the limit gets a 429 naming the limit and marked not to be retried
    (`x-should-retry: false`), so the SDK raises it at once instead of retrying in silence; finishing
    one frees a place."""
    opened, limit = [], gw.sessions.max_sessions
    with client(gw, "carol") as http, fast(30):
        try:
            while (reply := http.post("/create_session", json={"tags": [], "user_metadata": {}})).status_code == 200 and len(opened) <= limit:
                opened.append(reply.json()["session_id"])
            assert len(opened) == limit
            refused(reply, 429, f"the limit is {limit} (OPENTINKER_TINKER_MAX_SESSIONS): close one")
            assert reply.headers["x-should-retry"] == "false"
            with fast(5), pytest.raises(tinker.RateLimitError, match=f"tenant carol has {limit} live Tinker sessions, the limit is {limit}"):
                tinker.ServiceClient(base_url=gw.url, api_key=gw.keys["carol"]).create_lora_training_client(base_model=BASE, rank=4)
            assert http.post(f"/sessions/{opened.pop()}/finish", json={}).status_code == 200
            opened.append(http.post("/create_session", json={}).json()["session_id"])
        finally:
            for session in opened:
                http.post(f"/sessions/{session}/finish", json={})
    assert not [s for s in gw.sessions.live if s.startswith("carol-")]
    still_works(gw, alice)
