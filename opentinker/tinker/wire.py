"""The Tinker wire format in and out, with the SDK's own protobuf schema (`tinker.proto`).

Requests of `forward_backward` arrive as protobuf (`ForwardBackwardRequest`, maybe zstd), results of
`forward_backward` and `sample` leave as protobuf (`ForwardBackwardOutput`, `SampleResponse`);
everything else is JSON. Nothing here needs torch: datums become numpy arrays. Anything a client
could send wrong (a bad protobuf, an image chunk, a tensor whose size disagrees with its shape, a
dtype the public API does not have) is a `WireError` with one line saying what.
"""

from __future__ import annotations

import hashlib
import io
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from tinker.proto import tinker_public_pb2 as pb

MAX_BODY_BYTES = 64 * 1024 * 1024  # one forward_backward chunk, decompressed (the SDK's own chunks stay under 5 MB)

MAX_TENSOR_VALUES = 16 * 1024 * 1024  # one datum's loss input, decoded (a 2-D sparse one can claim any shape)
_NUMPY = {pb.DTYPE_FLOAT32: np.float32, pb.DTYPE_INT64: np.int64, pb.DTYPE_INT32: np.int32}


class WireError(ValueError):
    """A request that does not decode; the message is what the client sees."""


@dataclass
class TokenDatum:
    """One datum: the model's input tokens and its loss inputs, each an array over those positions."""

    tokens: list[int]
    inputs: dict[str, np.ndarray] = field(default_factory=dict)


@dataclass
class ForwardBackwardCall:
    model_id: str
    seq_id: int
    data: list[TokenDatum]
    loss_fn: str
    loss_fn_config: dict[str, float]
    forward_only: bool
    digest: str = ""  # of the request's content (deterministic protobuf): a retry's equals its first send's


def decompress(body: bytes, encoding: str | None) -> bytes:
    """The body as sent, unzstd'ed when `Content-Encoding: zstd` (at most MAX_BODY_BYTES)."""
    if not encoding or encoding.lower() == "identity":
        return body
    if encoding.lower() != "zstd":
        raise WireError(f"Content-Encoding {encoding!r} is not supported (zstd or none)")
    import zstandard

    try:  # read at most one byte past the limit: a small body that inflates to gigabytes stops there
        with zstandard.ZstdDecompressor().stream_reader(io.BytesIO(body)) as reader:
            data = reader.read(MAX_BODY_BYTES + 1)
    except zstandard.ZstdError as err:
        raise WireError(f"the body is not valid zstd: {err}") from None
    if len(data) > MAX_BODY_BYTES:
        raise WireError(f"the body inflates to more than {MAX_BODY_BYTES // 2**20} MiB")
    return data


def header_of(body: bytes) -> tuple[str, int]:
    """(model_id, seq_id) of a ForwardBackwardRequest, for routing and ordering before a full decode."""
    msg = pb.ForwardBackwardRequest()
    try:
        msg.ParseFromString(body)
    except Exception as err:  # noqa: BLE001 - protobuf's DecodeError and friends
        raise WireError(f"the forward_backward body is not a ForwardBackwardRequest protobuf ({type(err).__name__})") from None
    return msg.model_id, msg.seq_id


def _varint(data: bytes, at: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if at >= len(data) or shift > 63:
            raise WireError("truncated")
        byte = data[at]
        value |= (byte & 0x7F) << shift
        at, shift = at + 1, shift + 7
        if not byte & 0x80:
            return value, at


def header_of_prefix(head: bytes) -> tuple[str, int] | None:
    """(model_id, seq_id) from the first bytes of a ForwardBackwardRequest (fields 1 and 2, which
    the SDK's protobuf writes first), for a body refused before it was read whole; None when they
    are not there."""
    found: dict[int, Any] = {}
    at = 0
    try:
        while len(found) < 2 and at < len(head):
            key, at = _varint(head, at)
            field_number, kind = key >> 3, key & 7
            if kind == 0:
                found[field_number], at = _varint(head, at)
            elif kind == 2:
                size, at = _varint(head, at)
                if at + size > len(head):
                    break
                found[field_number], at = head[at : at + size], at + size
            else:
                break
    except WireError:
        return None
    model_id, seq_id = found.get(1), found.get(2)
    if not isinstance(model_id, bytes) or not isinstance(seq_id, int):
        return None
    try:
        return model_id.decode(), seq_id
    except UnicodeDecodeError:
        return None


def _array(name: str, tensor: pb.Tensor) -> np.ndarray:
    dtype = _NUMPY.get(tensor.dtype)
    if dtype is None:
        raise WireError(f"loss_fn_inputs[{name!r}]: dtype {pb.DType.Name(tensor.dtype) if tensor.dtype in pb.DType.values() else tensor.dtype} "
                        "is not supported (float32, int64 or int32)")
    shape = [int(s) for s in tensor.shape]
    if any(s < 0 for s in shape) or len(shape) > 2:
        raise WireError(f"loss_fn_inputs[{name!r}]: shape {shape} (1 or 2 dimensions)")
    size = int(np.prod(shape, dtype=np.int64)) if shape else None
    if size is not None and size > MAX_TENSOR_VALUES:
        raise WireError(f"loss_fn_inputs[{name!r}]: shape {shape} holds more than {MAX_TENSOR_VALUES} values")
    if tensor.HasField("sparse_csr"):
        if len(shape) != 2:
            raise WireError(f"loss_fn_inputs[{name!r}]: a sparse tensor needs a 2-D shape, got {shape}")
        values = np.frombuffer(tensor.sparse_csr.values, dtype=dtype)
        crow = np.frombuffer(tensor.sparse_csr.crow_indices, dtype=np.int64)
        cols = np.frombuffer(tensor.sparse_csr.col_indices, dtype=np.int64)
        ok = (len(crow) == shape[0] + 1 and len(cols) == len(values) and (len(crow) == 0 or (crow[0] == 0 and crow[-1] == len(values)))
              and bool(np.all(np.diff(crow) >= 0)) and bool(np.all((cols >= 0) & (cols < max(shape[1], 1)))))
        if not ok:
            raise WireError(f"loss_fn_inputs[{name!r}]: malformed sparse CSR tensor")
        dense = np.zeros(shape, dtype=dtype)
        rows = np.repeat(np.arange(shape[0]), np.diff(crow))
        dense[rows, cols] = values
        return dense
    raw = tensor.dense
    if len(raw) % np.dtype(dtype).itemsize:
        raise WireError(f"loss_fn_inputs[{name!r}]: {len(raw)} bytes is not a whole number of {np.dtype(dtype).name}")
    values = np.frombuffer(raw, dtype=dtype)
    if size is not None and size != values.size:
        raise WireError(f"loss_fn_inputs[{name!r}]: shape {shape} holds {size} values, {values.size} were sent")
    return values.reshape(shape) if shape else values


def decode_forward_backward(body: bytes) -> ForwardBackwardCall:
    msg = pb.ForwardBackwardRequest()
    try:
        msg.ParseFromString(body)
    except Exception as err:  # noqa: BLE001
        raise WireError(f"the forward_backward body is not a ForwardBackwardRequest protobuf ({type(err).__name__})") from None
    data = []
    for i, datum in enumerate(msg.data):
        tokens: list[int] = []
        for chunk in datum.model_input:
            kind = chunk.WhichOneof("chunk")
            if kind != "encoded_text":
                raise WireError(f"data[{i}]: {kind or 'empty'} chunks are not supported here (text models: encoded_text only)")
            raw = chunk.encoded_text.tokens
            if len(raw) % 4:
                raise WireError(f"data[{i}]: encoded_text tokens must be int32 little-endian ({len(raw)} bytes)")
            tokens.extend(np.frombuffer(raw, dtype="<i4").tolist())
        inputs = {name: _array(name, tensor) for name, tensor in datum.loss_fn_inputs.items()}
        data.append(TokenDatum(tokens, inputs))
    config: dict[str, float] = {k: float(v) for k, v in msg.loss_fn_config.items()}
    for key, value in msg.loss_fn_config_v2.items():
        if value.WhichOneof("value") == "text":
            raise WireError(f"loss_fn_config[{key!r}]: text values are not taken by {msg.loss_fn or 'this loss'}")
        config[key] = float(value.number)
    digest = hashlib.sha256(msg.SerializeToString(deterministic=True)).hexdigest()
    return ForwardBackwardCall(msg.model_id, msg.seq_id, data, msg.loss_fn, config, msg.forward_only, digest)


def encode_forward_backward(outputs: list[dict[str, np.ndarray]], metrics: dict[str, float]) -> bytes:
    """A ForwardBackwardOutput: ArrayRecords whose fields hold the datums' arrays back to back, one
    record per run of consecutive datums with the same trailing shape ([] for [N] outputs, [K] for
    soft targets' [N, K]), as the SDK rebuilds them."""
    out = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord")
    for key, value in metrics.items():
        out.metrics[key] = float(value)
    runs: list[list[dict[str, np.ndarray]]] = []
    for o in outputs:
        trailing = [np.shape(v)[1:] for v in o.values()]
        if not runs or [np.shape(v)[1:] for v in runs[-1][0].values()] != trailing:
            runs.append([])
        runs[-1].append(o)
    for run in runs or [[]]:
        record = out.loss_fn_outputs.add(type_tag="ArrayRecord", num_datums=len(run))
        for name in (run[0] if run else {}):
            arrays = [np.ascontiguousarray(o[name], dtype=np.float32) for o in run]
            offsets = np.cumsum([0] + [a.nbytes for a in arrays]).astype(np.int64)
            record.fields[name].CopyFrom(pb.BatchedTensor(data=b"".join(a.tobytes() for a in arrays), offsets=offsets.tobytes(),
                                                          dtype=pb.DTYPE_FLOAT32, trailing_shape=list(arrays[0].shape[1:])))
    return out.SerializeToString()


@dataclass
class Sequence:
    tokens: list[int]
    logprobs: list[float]
    stop_reason: str  # "stop" | "length"


def _topk(rows: list[list[tuple[int, float]]] | None) -> pb.TopkLogprobs | None:
    if not rows:
        return None
    k = max((len(r) for r in rows), default=0)
    ids = np.zeros((len(rows), k), dtype=np.int32)
    lps = np.full((len(rows), k), -99999.0, dtype=np.float32)
    for i, row in enumerate(rows):
        for j, (token, lp) in enumerate(row):
            ids[i, j], lps[i, j] = token, lp
    return pb.TopkLogprobs(token_ids=ids.tobytes(), logprobs=lps.tobytes(), k=k, length=len(rows))


def encode_sample(sequences: list[Sequence], prompt_logprobs: list[float] | None = None,
                  topk_prompt: list[list[tuple[int, float]]] | None = None) -> bytes:
    """A SampleResponse; `prompt_logprobs` with NaN where there is none (position 0)."""
    out = pb.SampleResponse()
    for s in sequences:
        out.sequences.add(stop_reason=pb.STOP_REASON_STOP if s.stop_reason == "stop" else pb.STOP_REASON_LENGTH,
                          tokens=np.asarray(s.tokens, dtype="<i4").tobytes(), logprobs=np.asarray(s.logprobs, dtype="<f4").tobytes())
    if prompt_logprobs is not None:
        out.prompt_logprobs = np.asarray(prompt_logprobs, dtype="<f4").tobytes()
    topk = _topk(topk_prompt)
    if topk is not None:
        out.topk_prompt_logprobs.CopyFrom(topk)
    return out.SerializeToString()
