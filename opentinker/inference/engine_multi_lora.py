"""Sampling for many adapters of one shared base in one batch: the samplers of a base-model worker.

An HFEngine (same calls, same continuous batching) whose model is a SharedBase's
(opentinker.backend.shared_base): no second copy of the base for sampling. A sampler is a LoRA
adapter of that base, registered under the sampler's id from its peft folder (a snapshot: the
training client's later steps do not change it). Requests of every adapter join one running batch
at the next decode step, each row through its own adapter (the rows follow their adapters as
they join and leave); each request draws from its own generator (a seeded request's, an
episode's of a hosted job: AdapterRollouts), so what it samples does not depend on what else runs.
Decode steps run on the worker's one compute thread (opentinker/backend/compute_thread.py),
beside training passes (the model stays in eval mode; adapters are fixed per step).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from opentinker.backend import compute_thread
from opentinker.backend.shared_base import SharedBase
from opentinker.inference.engine_hf import HFEngine


class MultiLoraEngine(HFEngine):
    kind = "hf-multi-lora"

    def __init__(self, shared: SharedBase, max_batch_size: int = 32):
        device = shared.placement.device
        super().__init__(shared.lm, shared.tokenizer, {"base_model": shared.base_name}, max_batch_size=max_batch_size,
                         placement=shared.placement, prefix_cache_tokens=0,
                         run_step=lambda step: compute_thread.run_on(device, step))  # the worker's one computing thread
        self.shared = shared
        self.adapters = {}

    @property
    def batches(self) -> int:
        """Decode steps run, and how many of them held rows of two adapters or more."""
        return self.rollout.stream.decode_forwards

    @property
    def mixed(self) -> int:
        return self.rollout.stream.mixed_forwards

    def load_adapter(self, name: str, path: str) -> None:
        """Register the peft adapter folder `path` (safetensors only) as `name`; ValueError when
        the name is taken or the folder is not a plain LoRA of this base."""
        folder = Path(path)
        if name in self.adapters:
            raise ValueError(f"adapter {name!r} is loaded already")
        if not (folder.is_absolute() and (folder / "adapter_config.json").is_file() and (folder / "adapter_model.safetensors").is_file()):
            raise ValueError(f"{path}: not a LoRA adapter folder (an absolute path holding adapter_config.json and adapter_model.safetensors)")
        self.rollout.stream.between_steps(lambda: self.shared.multi.load(name, folder))  # not under a running step
        self.adapters[name] = str(folder)

    def unload_adapter(self, name: str) -> None:
        if name not in self.adapters:
            raise KeyError(name)
        self.rollout.stream.between_steps(lambda: self.shared.multi.remove(name))
        del self.adapters[name]

    def _adapter(self, name: str | None) -> Any:
        if name is not None and name not in self.adapters:
            raise KeyError(name)
        return self.shared.multi.rows([name])

    def _admits(self, seq: Any, running: list[Any]) -> bool:
        """Any adapter joins (each row goes through its own); images do not (text only here)."""
        return not seq.images

    def _row_scope(self, names: list[str | None]) -> Any:
        unknown = sorted({n for n in names if n is not None and n not in self.adapters})
        if unknown:
            raise KeyError(f"unknown adapters: {unknown}")
        return self.shared.multi.rows(names)

    def serve_training_adapter(self, name: str) -> None:
        """Sample from adapter `name` of the shared base as it is now (a hosted job's live adapter, not a snapshot)."""
        if name in self.adapters:
            raise ValueError(f"adapter {name!r} is loaded already")
        self.adapters[name] = "(training)"

    def release_training_adapter(self, name: str) -> None:
        """No more requests for `name` (the adapter itself stays with its owner)."""
        self.adapters.pop(name, None)


class AdapterRollouts:
    """A hosted job's rollout engine (its sampler's `engine`): the episodes' turns go to the base's
    MultiLoraEngine under the job's live training adapter, so rows of several jobs (and Tinker
    samplers) decode in one batch. Sampling follows the adapter as the job's updates change it
    (the version handshake of a colocated job). Its draws come from `generator`, the job's own,
    seeded with the job's seed (its checkpoints keep its state: opentinker.rl.policy), so what it
    samples does not depend on the other tenants of the base."""

    def __init__(self, engine: MultiLoraEngine, name: str, seed: int):
        import torch

        self.engine, self.name = engine, name
        self.generator = torch.Generator(device=engine.shared.placement.device).manual_seed(seed)
        engine.serve_training_adapter(name)
        self.policy_version = 0
        self.generated_tokens = 0
        self.generate_seconds = 0.0

    def generate(self, prompts: list[list[int]], params: Any, budgets: list[int] | None = None,
                 images: list[list[Any]] | None = None, stop_rule: Any = None, generators: list[Any] | None = None) -> list[Any]:
        """As HFRolloutEngine.generate (called by the job's episodes at once, each its own turn);
        `generators[0]`: where the request's draws come from (default: the job's own)."""
        if images is not None and any(images):
            raise ValueError("a job on a shared base-model worker samples text only")
        t0 = time.perf_counter()
        budgets = [min(b, params.max_new_tokens) for b in budgets or [params.max_new_tokens] * len(prompts)]  # as HFRolloutEngine
        generator = generators[0] if generators and generators[0] is not None else self.generator
        completions = self.engine.generate(prompts, budgets, params, adapter=self.name, stop_rule=stop_rule,
                                           generator=generator, version=lambda: self.policy_version).result()
        self.generated_tokens += sum(len(c.token_ids) for c in completions)
        self.generate_seconds += time.perf_counter() - t0
        return completions

    def end_phase(self) -> None:
        """Nothing is cached per job (the shared engine keeps no prefix cache)."""

    def shared_metrics(self) -> dict[str, float]:
        """How often the base's sampling batches (so far, every tenant's) held rows of several adapters."""
        return {"rollout/batch_share": self.engine.mixed / self.engine.batches if self.engine.batches else 0.0}

    def close(self) -> None:
        self.engine.release_training_adapter(self.name)
