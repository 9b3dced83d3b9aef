"""The Tinker door under hostile or unlucky use, through the unmodified `tinker` SDK against a
gateway whose sessions run in this process (issue 40's attempts at test size):

- two processes driving one training client (the SDK's own `InternalClientHolder(session_id=…)`
  and `TrainingClient`): the second is refused in one line, never answered with the first's results;
- a forward_backward over the bound on a call's tokens fails at once with the numbers, however the
  SDK chunks it, and nothing of it runs;
- a call the gateway refuses (another tenant's path, a body over its limit) does not hold the
  client's next call for the gap timer (GAP_WAIT_S, 60 s).
"""

from __future__ import annotations

import time

import numpy as np
import pytest

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402

BASE = "tiny-random"
BOUND = 5000  # tokens of one forward(_backward) call, for these sessions


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    from opentinker.control.gateway.tinker_local import local_gateway

    url, keys, sessions, server = local_gateway(tmp_path_factory.mktemp("hostile"), tenants=("alice", "bob"), max_call_tokens=BOUND,
                                                max_request_bytes=256 * 1024)
    services = {name: tinker.ServiceClient(base_url=url, api_key=key) for name, key in keys.items()}
    yield url, keys, services
    for service in services.values():
        service.close("success")
    server.stop()
    sessions.close()


def datum(tokens: list[int], **inputs) -> types.Datum:
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs={"target_tokens": tokens[1:], **inputs})


def data(n: int, length: int = 9, start: int = 0) -> list[types.Datum]:
    return [datum([(start + 13 * i + 7 * j) % 4000 + 100 for j in range(length)], weights=[1.0] * (length - 1)) for i in range(n)]


def grad_norm(trainer) -> float:
    """The norm of what the model's gradient holds (the optimizer step clears it; a step of learning rate 0 changes nothing else)."""
    return trainer.optim_step(types.AdamParams(learning_rate=0.0)).result().metrics["grad_norm:mean"]


def test_a_second_client_of_one_training_client_is_refused_and_never_gets_the_firsts_results(gateway):
    from tinker.lib.internal_client_holder import InternalClientHolder
    from tinker.lib.public_interfaces.training_client import TrainingClient

    url, keys, services = gateway
    first = services["alice"].create_lora_training_client(base_model=BASE, rank=4, seed=0).result()
    holder = InternalClientHolder(session_id=first.holder.get_session_id(), base_url=url, api_key=keys["alice"])
    second = TrainingClient(holder, model_seq_id=first._training_client_id, model_id=first.model_id, info=first.get_info())
    mine = first.forward_backward(data(4), "cross_entropy").result()  # seq_id 1
    assert len(mine.loss_fn_outputs) == 4
    with pytest.raises(Exception, match=r"seq_id 1 of .* was used already by another request \(forward_backward, a different body\): "
                                         r"a training client takes its calls from one TrainingClient at a time"):
        second.forward_backward(data(1, start=50), "cross_entropy").result()
    first.optim_step(types.AdamParams(learning_rate=1e-3)).result()  # seq_id 2
    again = first.forward_backward(data(4), "cross_entropy").result()  # seq_id 3: the first client goes on, its own results
    assert len(again.loss_fn_outputs) == 4
    # the second client's step is the same request as the first's seq_id 2, but that one was followed by seq_id 3 since
    with pytest.raises(Exception, match=r"seq_id 2 of .* was answered already and later calls followed it"):
        second.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    holder.close()


def test_a_resent_call_is_answered_once_and_a_different_body_under_its_seq_id_fails(gateway):
    """Raw HTTP, as the SDK's retries send: the same body again gets the first request's id; a
    different body under the same seq_id gets a request of its own that fails in one line."""
    import httpx
    from tinker.proto import tinker_public_pb2 as pb

    url, keys, services = gateway
    model_id = services["alice"].create_lora_training_client(base_model=BASE, rank=4, seed=1).result().model_id
    http = httpx.Client(base_url=f"{url}/api/v1", headers={"X-API-Key": keys["alice"]}, timeout=60)

    def body(first_token: int) -> bytes:
        msg = pb.ForwardBackwardRequest(model_id=model_id, seq_id=1, loss_fn="cross_entropy")
        tokens = [first_token, *range(200, 210)]
        entry = msg.data.add()
        entry.model_input.add().encoded_text.tokens = np.asarray(tokens[:-1], dtype="<i4").tobytes()
        entry.loss_fn_inputs["target_tokens"].CopyFrom(pb.Tensor(dense=np.asarray(tokens[1:], "<i8").tobytes(), dtype=pb.DTYPE_INT64,
                                                                 shape=[10]))
        return msg.SerializeToString()

    headers = {"Content-Type": "application/x-protobuf"}
    first = http.post("/forward_backward", content=body(100), headers=headers).json()["request_id"]
    assert http.post("/forward_backward", content=body(100), headers=headers).json()["request_id"] == first
    other = http.post("/forward_backward", content=body(101), headers=headers).json()["request_id"]
    assert other != first
    answer = http.post("/retrieve_future", json={"request_id": other}).json()
    assert answer["category"] == "user" and "was used already by another request" in answer["error"]
    out = pb.ForwardBackwardOutput()
    out.ParseFromString(http.post("/retrieve_future", json={"request_id": first}, headers={"Accept": "application/x-protobuf"}).content)
    assert out.loss_fn_outputs[0].num_datums == 1


@pytest.mark.parametrize("rows, length", [(450, 13), (1100, 8), (2100, 8)], ids=["one-chunk", "two-chunks", "three-chunks"])
def test_a_call_over_the_token_bound_fails_at_once_with_the_numbers_and_nothing_of_it_runs(gateway, rows, length):
    """The SDK sends at most 1,024 datums a chunk, the first chunk last: over the bound (5,000 tokens
    here) fails whether one chunk holds it, the first chunk tips it, or later chunks do before the
    first comes. The client's next call runs at once, on a gradient the refused call never touched."""
    _, _, services = gateway
    trainer = services["alice"].create_lora_training_client(base_model=BASE, rank=4, seed=2).result()
    start = time.monotonic()
    with pytest.raises(Exception, match=rf"forward_backward: a call of [\d,]+ tokens \(or more\) is over this server's bound of "
                                         rf"{BOUND:,} tokens a call \(OPENTINKER_TINKER_MAX_CALL_TOKENS\)"):
        trainer.forward_backward(data(rows, length), "cross_entropy").result()
    assert grad_norm(trainer) == 0.0  # nothing of it ran
    assert time.monotonic() - start < 20
    done = trainer.forward_backward(data(8, length), "cross_entropy").result()  # under the bound: runs
    assert len(done.loss_fn_outputs) == 8 and grad_norm(trainer) > 0


def test_a_call_refused_at_the_gateway_does_not_delay_the_next_one(gateway):
    """Another tenant's path (404) and a body over the gateway's limit (413) never reach the
    session; it is told their seq_ids will not come, so the next call returns within 2 s."""
    _, _, services = gateway
    trainer = services["alice"].create_lora_training_client(base_model=BASE, rank=4, seed=3).result()
    bobs = services["bob"].create_lora_training_client(base_model=BASE, rank=4, seed=3).result()
    bobs_path = bobs.save_state("b1").result().path
    with pytest.raises(Exception, match="no such id"):
        trainer.load_state(bobs_path).result()
    start = time.monotonic()
    trainer.forward_backward(data(2), "cross_entropy").result()
    assert time.monotonic() - start < 2.0
    huge = [datum(list(range(100, 110)), weights=[1.0] * 9, advantages=[0.5] * 9)]
    huge[0].loss_fn_inputs["weights"] = types.TensorData(data=[1.0] * 200_000, dtype="float32", shape=[200_000])
    with pytest.raises(Exception, match="413|over the limit"):
        trainer.forward_backward(huge, "cross_entropy").result()
    start = time.monotonic()
    trainer.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    assert time.monotonic() - start < 2.0
