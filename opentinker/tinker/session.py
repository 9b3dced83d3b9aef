"""One Tinker session: its training clients' models, its samplers, and the futures of their calls.

A call that the SDK treats as a future (create_model, forward_backward, optim_step, saves, loads,
asample) is accepted at once with a request id and runs in the background; `result` waits for it
(long-poll). A training client's calls run one at a time in `seq_id` order (chunks of one
forward_backward arrive out of order, the first one last). A repeated `(model_id, seq_id)` with
the same body, before any later call, is the SDK retrying: it gets the first request's id back
instead of running twice; any other reuse of a seq_id is a second client driving the same model,
and fails in one line (never answered with another request's result). A forward(_backward) call
holds at most `max_call_tokens` tokens, all its chunks together (Sequencer). Samples run through
an `HFEngine` per base model that batches concurrent requests, each sampler a LoRA adapter loaded
in it by name.

Errors a caller caused (BadRequest, WireError, PathError, NotFound, UnsupportedLoss, UnknownModel)
complete the future as `{"error", "category": "user"}`; anything else as category "server" with
one line, the traceback in the log. Either way the session and its other models live on.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import tempfile
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from opentinker.core.errors import one_line
from opentinker.tinker import paths, wire
from opentinker.tinker.models import resolve_base, tokenizer_id
from opentinker.tinker.sampling import SamplerRecord, Samplers, parse_sample_request
from opentinker.tinker.sequencing import Queued, Replays, Sequencer, failed

log = logging.getLogger("opentinker.tinker")

KEEP_RESULTS_S = 600.0  # a completed future can be re-polled for this long
USER_ERRORS: tuple[type[BaseException], ...] = (ValueError, LookupError)  # BadRequest, WireError, PathError, NotFound, …


@functools.cache
def empty_optimizer() -> bytes:
    """optimizer.pt of a checkpoint without optimizer moments (torch's format, an empty dict)."""
    import io

    import torch

    buf = io.BytesIO()
    torch.save({}, buf)
    return buf.getvalue()


def _raise(err: BaseException) -> None:
    raise err


def error_payload(err: BaseException) -> dict[str, str]:
    user = isinstance(err, USER_ERRORS)
    if not user:
        log.error("tinker call failed", exc_info=err)
    line = (str(err).splitlines() or [type(err).__name__])[0] if user else one_line(err)
    return {"error": line, "category": "user" if user else "server"}


@dataclass
class Pending:
    future: Future
    done_at: float | None = None


@dataclass
class TrainingSlot:
    model: Any  # PrimitiveModel
    base_name: str  # as the client named it
    sequencer: Sequencer
    user_metadata: dict[str, Any] = field(default_factory=dict)


class TinkerSession:
    """The state of session `session_id` of `tenant`, checkpoints under `storage_url`.
    `on_step(model_id, step, metrics)` is told of every optimizer step (MLflow)."""

    def __init__(self, session_id: str, tenant: str, storage_url: str, models_folder: Path, placement: Any = None,
                 on_step: Callable[[str, int, dict[str, float]], None] | None = None, trainers: Callable[..., Any] | None = None,
                 engines: Any = None, max_call_tokens: int | None = None):
        """`trainers(model_id, base_name, shape, tenant)`: a training client's model (default: its own base's; shared_base's adapters);
        `engines`: sampling engines shared with other sessions (SamplingEngines; default: the session's own);
        `max_call_tokens`: the most tokens of one forward(_backward) call (None: no bound)."""
        self.session_id, self.tenant, self.models_folder = session_id, tenant, models_folder
        self.trainers = trainers or self._own_base
        self.shares_process = trainers is not None  # other sessions' clients live in this process too
        self.placement = placement
        self.store = paths.TenantCheckpoints(storage_url)
        self.on_step = on_step or (lambda *_: None)
        self.models: dict[str, TrainingSlot] = {}
        self.samplers = Samplers(Path(tempfile.mkdtemp(prefix=f"tinker-{session_id}-")), placement, engines)
        self.futures: dict[str, Pending] = {}
        self.max_call_tokens = max_call_tokens
        self.replays = Replays()
        self.counter = 0
        self.lock = threading.Lock()
        self.pool = ThreadPoolExecutor(64, thread_name_prefix="tinker-call")  # samples wait on the engine's batches here
        self.last_seen = time.monotonic()
        self.polls = 0  # result polls held here now
        self.finished: str | None = None
        self.expired: str | None = None  # why the gateway ended it (its client gone, its place needed)

    # -- bookkeeping -----------------------------------------------------------------------
    def touch(self) -> None:
        self.last_seen = time.monotonic()

    def idle_seconds(self) -> float:
        """Since the client was last heard; 0 while one of its polls for a result is held here (a
        live client waiting on a long call is not idle; a dead one's poll ends within the hold)."""
        return 0.0 if self.polls else time.monotonic() - self.last_seen

    def tick(self) -> None:
        for slot in list(self.models.values()):
            slot.sequencer.tick()
        cutoff = time.monotonic() - KEEP_RESULTS_S
        with self.lock:
            for rid in [r for r, p in self.futures.items() if p.done_at is not None and p.done_at < cutoff]:
                del self.futures[rid]

    def _new_request(self) -> tuple[str, Future]:
        with self.lock:
            self.counter += 1
            rid = f"{self.session_id}:req:{self.counter}"
            pending = Pending(Future())
            self.futures[rid] = pending
        pending.future.add_done_callback(lambda _: setattr(pending, "done_at", time.monotonic()))
        return rid, pending.future

    def _complete(self, future: Future, fn: Callable[[], Any]) -> None:
        try:
            future.set_result(fn())
        except BaseException as err:  # noqa: BLE001 - every failure becomes the future's error payload
            future.set_result(error_payload(err))

    def _slot(self, model_id: str) -> TrainingSlot:
        slot = self.models.get(model_id)
        if slot is None:
            raise paths.NotFound(f"no model {model_id!r} in this session")
        return slot

    def result(self, request_id: str, timeout: float) -> Any | None:
        """The completed result (bytes: protobuf; dict: JSON), or None after `timeout` seconds."""
        self.touch()
        pending = self.futures.get(request_id)
        if pending is None:
            raise paths.NotFound(f"no request {request_id!r} (unknown, or its result expired)")
        with self.lock:
            self.polls += 1
        try:
            return pending.future.result(timeout=timeout)
        except FutureTimeout:
            return None
        finally:
            with self.lock:
                self.polls -= 1
            self.touch()

    # -- entry points ------------------------------------------------------------------------
    def submit(self, op: str, body: Any) -> dict[str, Any]:
        """Accept a future call; returns the promise (`request_id`, and `sample_sequence_ids` for samples)."""
        self.touch()
        if op == "forward_backward":  # decoded once, here; a datum that does not decode fails in its turn
            try:
                call = wire.decode_forward_backward(body)
            except wire.WireError as err:
                failure = err  # `err` is unbound once the except block ends
                model_id, seq_id = wire.header_of(body)
                return self._sequenced(model_id, seq_id, op, hashlib.sha256(body).hexdigest(), lambda: _raise(failure))
            tokens = sum(len(d.tokens) for d in call.data)
            return self._sequenced(call.model_id, call.seq_id, op, call.digest, lambda: self.forward_backward(call), tokens)
        if op in ("optim_step", "save_weights", "save_weights_for_sampler", "save_weights_external") or (op == "load_weights" and body.get("model_id")):
            model_id, seq_id = str(body.get("model_id", "")), int(body.get("seq_id") or 0)
            digest = hashlib.sha256(json.dumps([op, body], sort_keys=True, default=str).encode()).hexdigest()
            return self._sequenced(model_id, seq_id, op, digest, lambda: getattr(self, op)(body))
        if op in ("create_model", "load_weights"):
            rid, future = self._new_request()
            self.pool.submit(self._complete, future, lambda: getattr(self, op)(body))
            return {"request_id": rid}
        if op == "asample":
            request = parse_sample_request(body)
            rid, future = self._new_request()
            self.pool.submit(self._complete, future, lambda: self.samplers.sample(request))
            return {"request_id": rid, "sample_sequence_ids": [f"{rid}:{i}" for i in range(request.num_samples)]}
        raise paths.NotFound(f"unknown call {op!r}")

    def _sequenced(self, model_id: str, seq_id: int, op: str, digest: str, fn: Callable[[], Any], tokens: int = 0) -> dict[str, Any]:
        """Accept a training client's call for its turn; a resend of one seen before gets that
        one's request id, another request under a used seq_id a failed request (sequencing.Replays)."""
        slot = self._slot(model_id)
        rid, future = self._new_request()
        known, why = self.replays.check(model_id, seq_id, op, digest, rid)
        if known is not None:
            self.futures.pop(rid, None)
            return {"request_id": known, "model_id": model_id}
        if why is not None:
            failed(future, why)
            return {"request_id": rid, "model_id": model_id}
        slot.sequencer.submit(seq_id, Queued(lambda: self._complete(future, fn), future, op, tokens))
        return {"request_id": rid, "model_id": model_id}

    def skip(self, body: dict[str, Any]) -> dict[str, Any]:
        """The gateway refused this training client's call `seq_id` (a bad path, a body too large):
        its later calls do not wait for it."""
        model_id, seq_id = str(body.get("model_id", "")), int(body.get("seq_id") or 0)
        if seq_id > 0:
            self._slot(model_id).sequencer.skip(seq_id)
        return {}

    # -- training clients --------------------------------------------------------------------
    def _own_base(self, model_id: str, base_name: str, shape: Any, tenant: str | None = None) -> Any:
        from opentinker.backend.primitives import PrimitiveModel
        from opentinker.model import load_model

        return PrimitiveModel(*load_model(resolve_base(self.models_folder, base_name)), base_name, shape, self.placement)

    def _build(self, model_id: str, base_name: str, shape: Any, metadata: dict[str, Any]) -> TrainingSlot:
        return TrainingSlot(self.trainers(model_id, base_name, shape, self.tenant), base_name,
                            Sequencer(model_id.rsplit(":", 1)[-1], self.max_call_tokens), metadata)

    def _model_id(self, body: dict[str, Any]) -> str:
        if body.get("session_id") != self.session_id:
            raise paths.NotFound(f"no session {body.get('session_id')!r}")
        model_id = paths.model_id(self.session_id, int(body.get("model_seq_id", 0)))
        if model_id in self.models:
            raise ValueError(f"model {model_id} exists already in this session")
        return model_id

    def _register(self, model_id: str, slot: TrainingSlot) -> None:
        self.models[model_id] = slot
        self.store.write_run(model_id, {"base_model": slot.base_name, "owner": self.tenant, "lora_rank": slot.model.shape.rank,
                                        "user_metadata": {str(k): str(v) for k, v in slot.user_metadata.items()},
                                        "created": paths.now_iso(), "session_id": self.session_id})

    def create_model(self, body: dict[str, Any]) -> dict[str, Any]:
        from opentinker.backend.primitives import LoraShape

        model_id = self._model_id(body)
        lora, optimizer_config = body.get("lora_config") or {}, body.get("optimizer_config") or {}
        if not isinstance(lora, dict) or not isinstance(optimizer_config, dict):
            raise ValueError("lora_config and optimizer_config: objects")
        optimizer = optimizer_config.get("type", "adamw")
        if optimizer != "adamw":
            raise ValueError(f"optimizer_config.type {optimizer!r}: only adamw is served here")
        try:
            rank, seed = int(lora.get("rank", 32)), None if lora.get("seed") is None else int(lora["seed"])
        except (TypeError, ValueError):
            raise ValueError("lora_config.rank and .seed: integers") from None
        shape = LoraShape(rank=rank, seed=seed, train_attn=bool(lora.get("train_attn", True)),
                          train_mlp=bool(lora.get("train_mlp", True)), train_unembed=bool(lora.get("train_unembed", True)))
        self._register(model_id, self._build(model_id, str(body.get("base_model", "")), shape, body.get("user_metadata") or {}))
        return {"model_id": model_id}

    def get_info(self, body: dict[str, Any]) -> dict[str, Any]:
        self.touch()
        slot = self._slot(str(body.get("model_id", "")))
        return {"model_id": body["model_id"], "is_lora": True, "lora_rank": slot.model.shape.rank,
                "model_data": {"model_name": slot.base_name, "tokenizer_id": tokenizer_id(slot.base_name, self.models_folder),
                               "arch": slot.model.arch},
                "optimizer_config": {"type": "adamw"}}

    def forward_backward(self, call: wire.ForwardBackwardCall) -> bytes:
        slot = self._slot(call.model_id)
        outputs, metrics = slot.model.forward_backward(call.data, call.loss_fn, call.loss_fn_config, call.forward_only)
        return wire.encode_forward_backward(outputs, metrics)

    def optim_step(self, body: dict[str, Any]) -> dict[str, Any]:
        from opentinker.backend.primitives import AdamParams, BadRequest

        slot = self._slot(body["model_id"])
        if body.get("optimizer_params") is not None:
            raise BadRequest(f"optimizer {body['optimizer_params'].get('type')!r}: only Adam (adam_params) is served here")
        given = body.get("adam_params") or {}
        if not isinstance(given, dict):
            raise BadRequest("adam_params: an object of learning_rate, beta1, beta2, eps, weight_decay, grad_clip_norm")
        try:
            adam = AdamParams(**{k: float(v) for k, v in given.items() if k in AdamParams.__dataclass_fields__})
        except (TypeError, ValueError) as err:
            raise BadRequest(f"adam_params: {err}") from None
        metrics = slot.model.optim_step(adam)
        self.on_step(body["model_id"], slot.model.steps, metrics)
        return {"metrics": metrics}

    # -- checkpoints ---------------------------------------------------------------------
    def _save(self, slot: TrainingSlot, path: paths.TinkerPath, body: dict[str, Any], with_optimizer: bool) -> None:
        from opentinker.storage.checkpoint import rng_state
        from opentinker.storage.committed import write_committed

        if self.store.exists(path) and not body.get("overwrite"):
            raise ValueError(f"{path} exists (pass overwrite=True to replace it)")
        files = slot.model.state_files(with_optimizer=with_optimizer)
        files.setdefault("optimizer.pt", empty_optimizer())  # a sampler checkpoint: the layout of any job's, no moments
        policy = slot.model.policy_info() | {"base_model": resolve_base(self.models_folder, slot.base_name)}  # a name the loaders know
        files |= {"policy.json": json.dumps(policy).encode(),
                  "state.json": json.dumps({"step": slot.model.steps, "kind": path.kind}).encode(),
                  # On a shared base the process's generators are every tenant's (their unseeded samples): a
                  # checkpoint records none of them (a client's state is its weights and moments; nothing restores these).
                  "rng.json": json.dumps({} if self.shares_process else rng_state()).encode()}
        ttl = body.get("ttl_seconds")
        write_committed(self.store.url(path), files, {"step": slot.model.steps, "user_metadata": body.get("user_metadata") or None,
                                                      "expires_at": paths.iso_in(float(ttl)) if ttl else None})

    def save_weights(self, body: dict[str, Any]) -> dict[str, Any]:
        slot = self._slot(body["model_id"])
        path = paths.TinkerPath(body["model_id"], "weights", paths.check_name(str(body.get("path", ""))))
        self._save(slot, path, body, with_optimizer=True)
        return {"path": str(path)}

    def save_weights_for_sampler(self, body: dict[str, Any]) -> dict[str, Any]:
        slot = self._slot(body["model_id"])
        if body.get("path"):
            path = paths.TinkerPath(body["model_id"], "sampler_weights", paths.check_name(str(body["path"])))
            self._save(slot, path, body, with_optimizer=False)
            return {"path": str(path)}
        sampler_id = f"{self.session_id}:sample:{int(body.get('sampling_session_seq_id') or 0)}"
        loader = resolve_base(self.models_folder, slot.base_name)
        if body.get("kind") == "inflight":  # samples use the weights saved now or newer (the SDK's contract): sampling.Samplers.add_inflight
            self.samplers.add_inflight(sampler_id, body["model_id"], slot.base_name, loader, slot.model)
        else:
            self.samplers.add_snapshot(sampler_id, slot.base_name, loader, slot.model)
        return {"sampling_session_id": sampler_id}

    def save_weights_external(self, body: dict[str, Any]) -> dict[str, Any]:
        """The LoRA adapter alone in peft's layout (adapter_config.json, adapter_model.safetensors),
        for the REST client's signed download URLs."""
        from opentinker.storage.committed import write_committed

        slot = self._slot(body["model_id"])
        path = paths.TinkerPath(body["model_id"], "external_weights", paths.check_name(str(body.get("path", ""))))
        if body.get("age_encryption_recipients"):
            raise ValueError("age_encryption_recipients: encrypted exports are not supported here")
        files = {name.split("/", 1)[1]: data for name, data in slot.model.state_files(with_optimizer=False).items()
                 if name.startswith("adapter/")}
        files["policy.json"] = json.dumps(slot.model.policy_info()).encode()
        ttl = body.get("ttl_seconds")
        write_committed(self.store.url(path), files, {"step": slot.model.steps, "expires_at": paths.iso_in(float(ttl)) if ttl else None})
        return {"path": str(path), "size_bytes": sum(len(d) for d in files.values())}

    def _read_checkpoint(self, path: paths.TinkerPath) -> tuple[Any, dict[str, Any]]:
        from opentinker.storage.checkpoint import CheckpointError, load_checkpoint, read_file

        url = self.store.url(path)
        if not self.store.exists(path):  # never saved, deleted, or past its TTL
            raise paths.NotFound(f"no checkpoint {path}")
        try:
            loaded = load_checkpoint(url)
            info = json.loads(read_file(url, "policy.json"))
        except CheckpointError as err:
            if "no valid" in str(err):
                raise paths.NotFound(f"no checkpoint {path}") from None
            raise ValueError(f"{path}: {str(err).replace(url, 'the checkpoint')}") from None
        return loaded, info

    def load_weights(self, body: dict[str, Any]) -> dict[str, Any]:
        from opentinker.backend.primitives import shape_from_policy

        path = paths.parse_path(str(body.get("path", "")), "weights")
        loaded, info = self._read_checkpoint(path)
        optimizer = loaded.optimizer_state if body.get("optimizer") else None
        if body.get("model_id"):  # the deprecated TrainingClient.load_state: into an existing model
            slot = self._slot(body["model_id"])
            slot.model.load_state(loaded.weights, optimizer, int(loaded.state.get("step", 0)))
            return {"path": str(path), "model_id": body["model_id"]}
        model_id = self._model_id(body)
        record = self.store.read_run(path.model_id)
        slot = self._build(model_id, record["base_model"], shape_from_policy(info), body.get("user_metadata") or record.get("user_metadata") or {})
        slot.model.load_state(loaded.weights, optimizer, int(loaded.state.get("step", 0)))
        self._register(model_id, slot)
        return {"path": str(path), "model_id": model_id}

    # -- samplers ----------------------------------------------------------------------------
    def create_sampling_session(self, body: dict[str, Any]) -> dict[str, Any]:
        self.touch()
        if body.get("session_id") != self.session_id:
            raise paths.NotFound(f"no session {body.get('session_id')!r}")
        sampler_id = f"{self.session_id}:sample:{int(body.get('sampling_session_seq_id') or 0)}"
        if body.get("model_path"):
            path = paths.parse_path(str(body["model_path"]), "sampler_weights")
            if not self.store.exists(path):
                raise paths.NotFound(f"no checkpoint {path}")
            record = self.store.read_run(path.model_id)
            self.samplers.add_checkpoint(sampler_id, record["base_model"], resolve_base(self.models_folder, record["base_model"]),
                                         self.store.url(path), str(path))
        elif body.get("base_model"):
            name = str(body["base_model"])
            self.samplers.add_base(sampler_id, name, resolve_base(self.models_folder, name))
        else:
            raise ValueError("create_sampling_session needs model_path or base_model")
        return {"sampling_session_id": sampler_id}

    def get_sampler(self, sampler_id: str) -> dict[str, Any]:
        self.touch()
        record: SamplerRecord = self.samplers.record(sampler_id)
        return {"sampler_id": sampler_id, "base_model": record.base_model, "model_path": record.model_path}

    def close(self) -> None:
        """Every model leaves: calls waiting for their turn fail, a call running stops at its next pass."""
        for slot in self.models.values():  # a shared base's adapters leave it
            slot.sequencer.close()
            slot.model.close()
        self.samplers.close()
        self.pool.shutdown(wait=False, cancel_futures=True)

