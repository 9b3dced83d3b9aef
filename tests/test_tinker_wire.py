"""The wire itself, with raw HTTP: zstd bodies, seq_id ordering of a training client's calls (a
later call waits for an earlier one that arrives last), deduplication of a resent call."""

from __future__ import annotations

import numpy as np
import pytest

tinker = pytest.importorskip("tinker")
import httpx  # noqa: E402
import zstandard  # noqa: E402
from tinker.proto import tinker_public_pb2 as pb  # noqa: E402


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from opentinker.control.gateway.tinker_local import local_gateway

    url, keys, sessions, server = local_gateway(tmp_path_factory.mktemp("wire"))
    service = tinker.ServiceClient(base_url=url, api_key=keys["alice"])
    model_id = service.create_lora_training_client(base_model="tiny-random", rank=4, seed=0).result().model_id
    yield httpx.Client(base_url=f"{url}/api/v1", headers={"X-API-Key": keys["alice"]}, timeout=60), model_id
    service.close("success")
    server.stop()
    sessions.close()


def fwdbwd(model_id: str, seq_id: int) -> bytes:
    tokens = list(range(200, 216))
    msg = pb.ForwardBackwardRequest(model_id=model_id, seq_id=seq_id, loss_fn="cross_entropy")
    datum = msg.data.add()
    datum.model_input.add().encoded_text.tokens = np.asarray(tokens[:-1], dtype="<i4").tobytes()
    for name, values, dtype, code in (("target_tokens", tokens[1:], "<i8", pb.DTYPE_INT64), ("weights", [1.0] * 15, "<f4", pb.DTYPE_FLOAT32)):
        datum.loss_fn_inputs[name].CopyFrom(pb.Tensor(dense=np.asarray(values, dtype=dtype).tobytes(), dtype=code, shape=[15]))
    return msg.SerializeToString()


def result(http: httpx.Client, request_id: str, proto: bool = False) -> httpx.Response:
    headers = {"Accept": "application/x-protobuf"} if proto else {}
    reply = http.post("/retrieve_future", json={"request_id": request_id, "allow_metadata_only": False}, headers=headers)
    assert reply.status_code == 200, reply.text
    return reply


def test_calls_run_in_seq_order_zstd_bodies_decode_and_resends_are_deduplicated(model):
    """optim_step (seq 2) sent before the zstd forward_backward (seq 1) still steps on its gradient;
    the same (model, seq) sent again gets the first request id back and runs once."""
    http, model_id = model
    step = http.post("/optim_step", json={"model_id": model_id, "seq_id": 2, "type": "optim_step",
                                          "adam_params": {"learning_rate": 1e-3, "beta1": 0.9, "beta2": 0.95, "eps": 1e-12,
                                                          "weight_decay": 0.0, "grad_clip_norm": 0.0}})
    assert step.status_code == 200, step.text
    body = zstandard.ZstdCompressor().compress(fwdbwd(model_id, 1))
    headers = {"Content-Type": "application/x-protobuf", "Content-Encoding": "zstd"}
    first = http.post("/forward_backward", content=body, headers=headers).json()["request_id"]
    again = http.post("/forward_backward", content=body, headers=headers).json()["request_id"]
    assert again == first
    out = pb.ForwardBackwardOutput()
    out.ParseFromString(result(http, first, proto=True).content)
    assert out.metrics["loss:sum"] > 0 and out.loss_fn_outputs[0].num_datums == 1
    metrics = result(http, step.json()["request_id"]).json()["metrics"]
    assert metrics["grad_norm:mean"] > 0 and metrics["tokens:sum"] == 15.0  # the gradient of seq 1, counted once


def test_outputs_of_several_shapes_decode_in_the_sdk_as_sent():
    """Soft targets' [N, K] logprobs beside [N] ones: one ArrayRecord per run of a trailing shape,
    which the SDK's own decoder rebuilds datum by datum, in order."""
    from tinker.proto.response_conv import deserialize_forward_backward_output

    from opentinker.tinker.wire import encode_forward_backward

    arrays = [np.arange(3, dtype=np.float32), np.arange(8, dtype=np.float32).reshape(4, 2),
              np.ones((2, 2), np.float32), np.arange(5, dtype=np.float32).reshape(1, 5), np.zeros(1, np.float32)]
    out = deserialize_forward_backward_output(encode_forward_backward([{"logprobs": a} for a in arrays], {"loss:sum": 1.0}))
    got = [o["logprobs"].to_numpy() for o in out.loss_fn_outputs]
    assert [g.shape for g in got] == [a.shape for a in arrays] and all(np.array_equal(g, a) for g, a in zip(got, arrays))
