"""The training clients of many sessions on one copy of each base model: a session's `trainers`
(opentinker.tinker.session) when its host shares bases (a base-model worker, or LocalSessions).

Each base a client names is loaded once, on first use, as a SharedBase (opentinker.backend.shared_base);
every training client of that base, whatever its session or tenant, is an adapter of it, named by
its model id (which holds the session id, so names never collide). Their samplers are adapters
of the same base too (`engines`: a MultiLoraEngine per base, requests of several samplers in one
batch), registered by sampler id, or of a vLLM server per base (`sampler_engines`, where
`tinker_sampling_engine` chooses vLLM); hosted jobs sample their live adapters on `engines`. `stats()` says what each base
holds and how often calls of several adapters shared a pass.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

from opentinker.backend import compute_thread
from opentinker.backend.device import cpu
from opentinker.backend.shared_base import SharedAdapter, SharedBase
from opentinker.core.settings import get_settings
from opentinker.inference.engine_multi_lora import MultiLoraEngine
from opentinker.inference.engine_vllm_lora import VLLMAdapterEngine, sampling_engine_kind
from opentinker.tinker.models import resolve_base
from opentinker.tinker.sampling import MAX_LOADED, SamplingEngines


class SharedBases:
    def __init__(self, models_folder: Path, placement: Any = None, memory_bytes: float | None = None):
        """`memory_bytes`: what each base and its adapters may fill (None: no bound)."""
        self.models_folder, self.placement, self.memory_bytes = models_folder, placement, memory_bytes
        self.bases: dict[str, SharedBase] = {}
        # Up to 128 rows a batch: a hosted job's rollout asks for its whole step at once (the demo's: 32 rows), and
        # several jobs' only share a batch when together they fit.
        self.engines = SamplingEngines(placement, factory=lambda loader_name: MultiLoraEngine(self.base(loader_name), max_batch_size=128))
        # Tinker's samplers: adapters of the shared base too, or of a vLLM server per base (`tinker_sampling_engine`)
        kind = sampling_engine_kind(get_settings().tinker_sampling_engine, placement or cpu())
        self.sampler_engines = self.engines if kind == "hf" else SamplingEngines(placement, factory=lambda loader_name: VLLMAdapterEngine.start(
            loader_name, placement, max_loras=MAX_LOADED, scorer=lambda: self.engines.engine(loader_name)))  # prompts scored on the shared base
        self.lock = threading.Lock()

    def base(self, loader_name: str, base_name: str | None = None) -> SharedBase:
        """The shared base of `loader_name`, loaded on first use."""
        with self.lock:
            if loader_name not in self.bases:
                from opentinker.model import load_model

                def load() -> SharedBase:  # on the compute thread: its arithmetic is this worker's (opentinker.backend.compute_thread)
                    base, tokenizer = load_model(loader_name)
                    return SharedBase(base, tokenizer, base_name or loader_name, self.placement, memory_bytes=self.memory_bytes)

                self.bases[loader_name] = compute_thread.run_on((self.placement or cpu()).device, load)
            return self.bases[loader_name]

    def __call__(self, model_id: str, base_name: str, shape: Any, tenant: str | None = None) -> SharedAdapter:
        """The training client `model_id` of `tenant` as an adapter of its base (passes take turns by tenant)."""
        shared = self.base(resolve_base(self.models_folder, base_name), base_name)  # UnknownModel for a name not served here
        adapter = shared.attach(model_id, shape, tenant)
        adapter.base_name = base_name  # as this client named it (an alias and the operator's name share one base)
        return adapter

    def adapters(self) -> dict[str, list[str]]:
        """Per base, the adapters (training clients' model ids) it hosts now."""
        return {name: sorted(shared.multi.adapters) for name, shared in self.bases.items()}

    def stats(self) -> dict[str, dict[str, float]]:
        return {name: {"adapters": len(shared.multi.adapters), "passes": shared.stats.passes, "calls": shared.stats.calls,
                       "batch_share": shared.stats.share(), "split_passes": shared.stats.split} for name, shared in self.bases.items()}

    def sampling_stats(self) -> dict[str, dict[str, int]]:
        """Per base, the sampling batches run and how many held rows of two adapters or more."""
        return {name: {"batches": engine.batches, "mixed": engine.mixed} for name, engine in self.engines.engines.items()}

    def close(self) -> None:
        for shared in self.bases.values():
            shared.close()
        self.engines.close()
        if self.sampler_engines is not self.engines:
            self.sampler_engines.close()
