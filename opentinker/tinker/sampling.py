"""Sampling clients: samplers (a base model, or a LoRA adapter on it) and the `asample` call.

Each base model gets one `HFEngine` (opentinker.inference.engine_hf) that batches concurrent
requests with equal parameters and stop rule; a sampler is an adapter loaded in it by name (its
sampler id), from a snapshot of a training client's weights or from a `sampler_weights`
checkpoint, or the base with no adapter. At most MAX_LOADED adapters stay loaded per engine;
an evicted one is loaded again from its folder when it is next used.

A sampler made from a checkpoint (`create_sampling_client(model_path=...)`) serves only while that
checkpoint exists: once it is deleted (or its TTL passes) the sampler's next call fails saying so
(looked at once per CHECK_EVERY_S). A snapshot (`save_weights_and_get_sampling_client`) is no
checkpoint: nothing deletes it, and it serves until the session ends or drops it.

Sampling follows the Tinker API: `stop` omitted stops at the end-of-sequence token, `[]` never
stops, token ids or strings stop at the first occurrence and keep it; `temperature` 0 is greedy;
`top_k` −1 and `top_p` 1 are off; the same `seed` gives the same tokens. Sampled logprobs are
those of the distribution each token was drawn from, in every reply: softmax(logits / temperature),
truncated and renormalised when top-k or top-p is on.
"""

from __future__ import annotations

import math
import shutil
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from opentinker.tinker import wire

MAX_LOADED = 16
MAX_SNAPSHOTS = 32  # ephemeral samplers kept (the cookbook makes one a step); the oldest is dropped, folder and all
MAX_SAMPLES = 128
CHECK_EVERY_S = 2.0  # how stale a sampler's look at its checkpoint may be (one small read of storage per look)


class BadSample(ValueError):
    pass


class CheckpointDeleted(LookupError):
    """The checkpoint a sampler was made from was deleted (or expired): the sampler serves no more."""


@dataclass(frozen=True)
class StopRule:
    """A row ends at the first stop token or once its text ends with a stop string. Compared by value."""

    token_ids: frozenset[int] = frozenset()
    strings: tuple[str, ...] = ()
    tokenizer: Any = field(default=None, compare=False, hash=False)

    def __call__(self, tokens: list[int]) -> bool:
        if tokens and tokens[-1] in self.token_ids:
            return True
        if self.strings:  # checked at every token, so a string found now was completed by this token
            tail = self.tokenizer.decode(tokens[-(max(len(s) for s in self.strings) + 4):])
            return any(s in tail for s in self.strings)
        return False


@dataclass
class SampleRequest:
    sampler_id: str
    prompt: list[int]
    num_samples: int
    max_tokens: int
    temperature: float
    top_k: int
    top_p: float
    seed: int | None
    stop: Any  # None (EOS), [] (never), [int...] or [str...]
    prompt_logprobs: bool
    topk_prompt_logprobs: int
    prompt_logprobs_last_n: int | None = None  # NaN before the last n positions


def _prompt_tokens(prompt: Any) -> list[int]:
    chunks = (prompt or {}).get("chunks") if isinstance(prompt, dict) else None
    if not isinstance(chunks, list) or not chunks:
        raise BadSample("prompt: a ModelInput with at least one chunk")
    tokens: list[int] = []
    for i, chunk in enumerate(chunks):
        kind = chunk.get("type", "encoded_text") if isinstance(chunk, dict) else None
        if kind != "encoded_text":
            raise BadSample(f"prompt.chunks[{i}]: {kind} chunks are not supported here (text models: encoded_text only)")
        ids = chunk.get("tokens")
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise BadSample(f"prompt.chunks[{i}].tokens: a list of token ids")
        tokens += ids
    if not tokens:
        raise BadSample("prompt: no tokens")
    return tokens


def parse_sample_request(body: dict[str, Any]) -> SampleRequest:
    """A checked SampleRequest from the SDK's JSON; BadSample names the field."""
    params = body.get("sampling_params") or {}
    if not isinstance(params, dict):
        raise BadSample("sampling_params: an object")
    for name in ("prompt_alt_tokens_k", "topk_sample_logprobs"):
        if body.get(name):
            raise BadSample(f"{name} is not supported here (prompt_logprobs and topk_prompt_logprobs are)")
    if body.get("target_prompt_logprobs") is not None:
        raise BadSample("target_prompt_logprobs is not supported here (prompt_logprobs and topk_prompt_logprobs are)")
    try:
        n = int(body.get("num_samples", 1))
        max_tokens = int(params.get("max_tokens") or 0)
        temperature = float(params.get("temperature", 1.0))
        top_k = int(params.get("top_k", -1) if params.get("top_k") is not None else -1)
        top_p = float(params.get("top_p", 1.0) if params.get("top_p") is not None else 1.0)
        seed = int(params["seed"]) if params.get("seed") is not None else None
        topk_prompt = int(body.get("topk_prompt_logprobs") or 0)
        last_n = int(body["prompt_logprobs_last_n"]) if body.get("prompt_logprobs_last_n") is not None else None
    except (TypeError, ValueError) as err:
        raise BadSample(f"sampling_params: {err}") from None
    if not 1 <= n <= MAX_SAMPLES:
        raise BadSample(f"num_samples: {n} (1 to {MAX_SAMPLES})")
    if max_tokens < 1:
        raise BadSample("sampling_params.max_tokens: at least 1")
    if not math.isfinite(temperature) or temperature < 0:
        raise BadSample(f"sampling_params.temperature: {temperature} (0 or more; 0 is greedy)")
    if not (0 < top_p <= 1) or not (top_k == -1 or top_k > 0) or not 0 <= topk_prompt <= 100:
        raise BadSample("sampling_params: top_p in (0, 1], top_k -1 or positive, topk_prompt_logprobs 0 to 100")
    stop = params.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and not (isinstance(stop, list) and (all(isinstance(s, str) and s for s in stop)
                                                              or all(isinstance(s, int) and not isinstance(s, bool) for s in stop))):
        raise BadSample("sampling_params.stop: a string, a list of strings or a list of token ids")
    return SampleRequest(str(body.get("sampling_session_id", "")), _prompt_tokens(body.get("prompt")), n, max_tokens, temperature,
                         top_k, top_p, seed, stop, bool(body.get("prompt_logprobs")), topk_prompt, last_n)


@dataclass
class SamplerRecord:
    base_model: str  # as the client named it
    loader_name: str
    folder: Path | None  # the adapter folder (None: the base alone)
    model_path: str | None = None
    checkpoint_url: str | None = None  # where model_path's checkpoint lives (None: the base or a snapshot)
    checked_at: float = 0.0  # when the checkpoint was last looked at (time.monotonic())
    deleted: bool = False  # what that look found


def own_engine(loader_name: str, placement: Any = None) -> Any:
    """A sampling engine with a base of its own, of the kind `tinker_sampling_engine` chooses here:
    vLLM's multi-LoRA server (opentinker.inference.engine_vllm_lora) or the HF engine taking adapters."""
    from opentinker.backend.device import cpu
    from opentinker.core.settings import get_settings
    from opentinker.inference.engine_vllm_lora import VLLMAdapterEngine, sampling_engine_kind

    if sampling_engine_kind(get_settings().tinker_sampling_engine, placement or cpu()) == "vllm":
        return VLLMAdapterEngine.start(loader_name, placement, max_loras=MAX_LOADED)
    from opentinker.inference.engine_hf import HFEngine

    return HFEngine.for_adapters(loader_name, where=placement)


class SamplingEngines:
    """One batching engine per base model and the adapters loaded in it (the MAX_LOADED most
    recently used; one evicted is loaded again from its folder when next asked for). A session's
    own, or one for every session of a base-model worker (sampler ids hold their session's id)."""

    def __init__(self, placement: Any = None, factory: Callable[[str], Any] | None = None):
        """`factory(loader_name)`: the engine of a base (default: `own_engine`, a base of its own)."""
        self.placement, self.factory = placement, factory or (lambda loader_name: own_engine(loader_name, placement))
        self.engines: dict[str, Any] = {}
        self.loaded: dict[str, OrderedDict[str, None]] = {}
        self.lock = threading.Lock()

    def engine(self, loader_name: str) -> Any:
        with self.lock:
            if loader_name not in self.engines:
                self.engines[loader_name] = self.factory(loader_name)
                self.loaded[loader_name] = OrderedDict()
            return self.engines[loader_name]

    def unload(self, loader_name: str, sampler_id: str) -> None:
        with self.lock:
            if sampler_id in self.loaded.get(loader_name, {}):
                self.engines[loader_name].unload_adapter(sampler_id)
                del self.loaded[loader_name][sampler_id]

    def ensure_loaded(self, loader_name: str, sampler_id: str, folder: Path) -> Any:
        engine = self.engine(loader_name)
        with self.lock:
            loaded = self.loaded[loader_name]
            if sampler_id in loaded:
                loaded.move_to_end(sampler_id)
                return engine
            while len(loaded) >= MAX_LOADED:
                oldest, _ = loaded.popitem(last=False)
                engine.unload_adapter(oldest)
            engine.load_adapter(sampler_id, str(folder))
            loaded[sampler_id] = None
        return engine

    def close(self) -> None:
        for engine in self.engines.values():
            engine.close()


class Samplers:
    """The session's samplers, on its own engines or on engines it shares (`engines`)."""

    def __init__(self, workdir: Path, placement: Any = None, engines: SamplingEngines | None = None):
        self.workdir = workdir
        self.pool, self.owns_engines = engines or SamplingEngines(placement), engines is None
        self.records: dict[str, SamplerRecord] = {}
        self.snapshots: OrderedDict[str, None] = OrderedDict()
        self.inflight: dict[str, str] = {}  # an inflight sampler -> the snapshot of its model's newest inflight save
        self.inflight_of: dict[str, list[str]] = {}  # a training model -> its inflight samplers

    def record(self, sampler_id: str) -> SamplerRecord:
        from opentinker.tinker.paths import NotFound

        found = self.records.get(self.inflight.get(sampler_id, sampler_id))
        if found is None:
            raise NotFound(f"no sampler {sampler_id!r} in this session (ephemeral samplers: only the {MAX_SNAPSHOTS} newest are kept)")
        return found

    def _engine(self, loader_name: str) -> Any:
        return self.pool.engine(loader_name)

    def add_base(self, sampler_id: str, base_model: str, loader_name: str) -> None:
        self._engine(loader_name)
        self.records[sampler_id] = SamplerRecord(base_model, loader_name, None)

    def add_snapshot(self, sampler_id: str, base_model: str, loader_name: str, model: Any) -> None:
        """The training client's weights as they are now (later steps do not change this sampler)."""
        folder = self._fresh_folder(sampler_id)
        for name, data in model.state_files(with_optimizer=False).items():
            if name.startswith("adapter/"):
                (folder / name.split("/", 1)[1]).write_bytes(data)
        self._replace(sampler_id, SamplerRecord(base_model, loader_name, folder))
        self.snapshots[sampler_id] = None
        while len(self.snapshots) > MAX_SNAPSHOTS:
            self._drop(self.snapshots.popitem(last=False)[0])

    def add_inflight(self, sampler_id: str, model_id: str, base_model: str, loader_name: str, model: Any) -> None:
        """The SDK's inflight contract: every inflight sampler of a training model samples its newest
        inflight save. The save is a snapshot of its own (a request running on the previous one
        finishes there), and this sampler and the model's earlier inflight ones move to it, so each
        samples the weights saved when it was made, or newer."""
        version = f"{sampler_id}:inflight"
        self.add_snapshot(version, base_model, loader_name, model)
        samplers = self.inflight_of.setdefault(model_id, [])
        samplers.append(sampler_id)
        for name in samplers:
            self.inflight[name] = version

    def _drop(self, sampler_id: str) -> None:
        record = self.records.pop(sampler_id, None)
        if record is None:
            return
        self.pool.unload(record.loader_name, sampler_id)
        if record.folder is not None:
            shutil.rmtree(record.folder, ignore_errors=True)

    def add_checkpoint(self, sampler_id: str, base_model: str, loader_name: str, url: str, model_path: str) -> None:
        from opentinker.storage.checkpoint import committed_manifest, read_file

        folder = self._fresh_folder(sampler_id)
        for name in (committed_manifest(url) or {}).get("files", {}):
            if name.startswith("adapter/"):
                (folder / name.split("/", 1)[1]).write_bytes(read_file(url, name))
        self._replace(sampler_id, SamplerRecord(base_model, loader_name, folder, model_path, url, time.monotonic()))

    def _fresh_folder(self, sampler_id: str) -> Path:
        folder = self.workdir / sampler_id.replace(":", "_")
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        return folder

    def _replace(self, sampler_id: str, record: SamplerRecord) -> None:
        self._engine(record.loader_name)
        self.pool.unload(record.loader_name, sampler_id)  # a new snapshot under the same id
        self.records[sampler_id] = record

    def _ensure_loaded(self, sampler_id: str, record: SamplerRecord) -> Any:
        if record.folder is None:
            return self._engine(record.loader_name)
        return self.pool.ensure_loaded(record.loader_name, sampler_id, record.folder)

    def _check_checkpoint(self, sampler_id: str, record: SamplerRecord) -> None:
        """Refuse to sample the weights of a deleted checkpoint: its owner deleted them. Its adapter
        leaves the engine then, not at the session's end (a slot of MAX_LOADED, and the weights);
        its folder stays, so a look that finds the checkpoint again (a storage blip) loads it anew."""
        from opentinker.tinker.paths import live_manifest

        if record.checkpoint_url is None:
            return
        if time.monotonic() - record.checked_at >= CHECK_EVERY_S:  # each look decides (a storage blip passes)
            record.deleted = live_manifest(record.checkpoint_url) is None
            record.checked_at = time.monotonic()
        if record.deleted:
            self.pool.unload(record.loader_name, sampler_id)  # a no-op once it is out (and at the session's end)
            raise CheckpointDeleted(f"sampler {sampler_id}: its checkpoint {record.model_path} was deleted (or its TTL passed), "
                                    "so it serves no more; make a sampling client from a checkpoint that exists "
                                    "(RestClient.list_checkpoints) or from a new save")

    def sample(self, request: SampleRequest) -> bytes:
        from opentinker.backend.rollout import SamplingParams

        sampler_id = self.inflight.get(request.sampler_id, request.sampler_id)  # an inflight one samples its model's newest save
        record = self.record(sampler_id)
        self._check_checkpoint(sampler_id, record)
        engine = self._ensure_loaded(sampler_id, record)
        vocab = engine.vocab_size
        if any(t < 0 or t >= vocab for t in request.prompt):
            raise BadSample(f"prompt: token ids must be in [0, {vocab}) for {record.base_model}")
        if len(request.prompt) + request.max_tokens > engine.context_length:
            raise BadSample(f"prompt ({len(request.prompt)} tokens) plus max_tokens ({request.max_tokens}) exceeds the "
                            f"model's context of {engine.context_length}")
        adapter = sampler_id if record.folder is not None else None
        if request.stop is None:
            rule = StopRule(frozenset(engine.stop_ids))
        elif request.stop and isinstance(request.stop[0], str):
            rule = StopRule(strings=tuple(request.stop), tokenizer=engine.tokenizer)
        else:
            rule = StopRule(frozenset(request.stop))
        params = SamplingParams(max_new_tokens=request.max_tokens, temperature=request.temperature or 1.0, top_p=request.top_p,
                                greedy=request.temperature == 0, top_k=request.top_k if request.top_k > 0 else None)
        future = engine.generate([request.prompt] * request.num_samples, [request.max_tokens] * request.num_samples, params,
                                 seed=request.seed, adapter=adapter, stop_rule=rule)
        prompt_lp, top = (None, None)
        if request.prompt_logprobs or request.topk_prompt_logprobs:
            prompt_lp, top = engine.score_prompt(request.prompt, adapter, request.topk_prompt_logprobs)
            if request.prompt_logprobs_last_n is not None:
                cut = max(0, len(prompt_lp) - request.prompt_logprobs_last_n)
                prompt_lp = [float("nan")] * cut + prompt_lp[cut:]
        completions = future.result()
        sequences = [wire.Sequence(c.token_ids, c.logprobs, c.finish_reason) for c in completions]
        return wire.encode_sample(sequences, prompt_lp if request.prompt_logprobs else None, top or None)

    def close(self) -> None:
        if self.owns_engines:
            self.pool.close()
        else:  # shared engines stay; this session's adapters leave them
            for sampler_id, record in list(self.records.items()):
                self.pool.unload(record.loader_name, sampler_id)
        shutil.rmtree(self.workdir, ignore_errors=True)
