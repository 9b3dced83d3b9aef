"""Sampling for many adapters of one shared base in one batch: the samplers of a base-model worker.

An HFEngine (same queue, same batching thread, same calls) whose model is a SharedBase's
(opentinker.backend.shared_base): no second copy of the base for sampling. A sampler is a LoRA
adapter of that base, registered under the sampler's id from its peft folder (a snapshot: the
training client's later steps do not change it). Requests of different adapters that share
their sampling parameters (arriving within `gather_s` of the first, while several samplers are
loaded) run as one batch in which each row goes through its own adapter (the
rows follow their adapters as finished rows leave the batch); a request with a seed runs alone,
as on any engine, so its samples do not depend on what else was asked, and a hosted job's
requests draw from the job's own generator (AdapterRollouts), so they may share a batch and still
sample what the job would sample alone: no request reseeds or reads the generator others draw from. Sampling batches run
beside training passes (the model stays in eval mode; adapters are fixed per pass and batch).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from opentinker.backend import compute_thread
from opentinker.backend.shared_base import SharedBase
from opentinker.inference.engine_hf import HFEngine, Request, request_generators


class MultiLoraEngine(HFEngine):
    kind = "hf-multi-lora"

    def __init__(self, shared: SharedBase, max_batch_size: int = 32, gather_s: float = 0.05):
        super().__init__(shared.lm, shared.tokenizer, {"base_model": shared.base_name}, max_batch_size=max_batch_size,
                         placement=shared.placement, prefix_cache_tokens=0)
        self.shared, self.gather_s = shared, gather_s
        self.adapters = {}
        self.rollout.row_scope = shared.multi.rows
        self.batches = 0  # batches run, and how many held two adapters or more
        self.mixed = 0

    def load_adapter(self, name: str, path: str) -> None:
        """Register the peft adapter folder `path` (safetensors only) as `name`; ValueError when
        the name is taken or the folder is not a plain LoRA of this base."""
        folder = Path(path)
        if name in self.adapters:
            raise ValueError(f"adapter {name!r} is loaded already")
        if not (folder.is_absolute() and (folder / "adapter_config.json").is_file() and (folder / "adapter_model.safetensors").is_file()):
            raise ValueError(f"{path}: not a LoRA adapter folder (an absolute path holding adapter_config.json and adapter_model.safetensors)")
        with self._model_lock:  # not while a batch runs
            self.shared.multi.load(name, folder)
        self.adapters[name] = str(folder)

    def unload_adapter(self, name: str) -> None:
        if name not in self.adapters:
            raise KeyError(name)
        with self._model_lock:  # a batch that holds it finishes first
            self.shared.multi.remove(name)
        del self.adapters[name]

    def _adapter(self, name: str | None) -> Any:
        if name is not None and name not in self.adapters:
            raise KeyError(name)
        return self.shared.multi.rows([name])

    def _gather(self) -> None:
        """With several samplers loaded, wait `gather_s` for other adapters' requests to join the batch."""
        if self.gather_s and len(self.adapters) > 1:
            time.sleep(self.gather_s)

    def _joins(self, first: Request, item: Request) -> bool:
        """Any adapter joins: the same sampling parameters and stop rule (and no images) suffice."""
        return item.params == first.params and item.stop_rule == first.stop_rule and not item.images

    def _run(self, batch: list[Request]) -> None:
        from dataclasses import replace

        prompts = [p for item in batch for p in item.prompts]
        budgets = [b for item in batch for b in item.budgets]
        names = [item.adapter for item in batch for _ in item.prompts]
        params = replace(batch[0].params, max_new_tokens=max(budgets))
        try:
            unknown = sorted({n for n in names if n is not None and n not in self.adapters})
            if unknown:
                raise KeyError(f"unknown adapters: {unknown}")
            with self._model_lock:  # decoded on the worker's compute thread (opentinker.backend.compute_thread)
                completions = compute_thread.run_on(self.shared.placement.device, self.rollout.generate, prompts, params, budgets,
                                                    stop_rule=batch[0].stop_rule, adapters=names,
                                                    generators=request_generators(batch, self.shared.placement.device))
        except Exception as err:  # noqa: BLE001 - the requests fail, the engine keeps serving
            for item in batch:
                item.future.set_exception(err)
            return
        self.batches += 1
        self.mixed += len({item.adapter for item in batch}) > 1
        start = 0
        for item in batch:
            item.future.set_result(completions[start : start + len(item.prompts)])
            start += len(item.prompts)

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
                 images: list[list[Any]] | None = None, stop_rule: Any = None) -> list[Any]:
        if images is not None and any(images):
            raise ValueError("a job on a shared base-model worker samples text only")
        t0 = time.perf_counter()
        budgets = [min(b, params.max_new_tokens) for b in budgets or [params.max_new_tokens] * len(prompts)]  # as HFRolloutEngine
        completions = self.engine.generate(prompts, budgets, params, adapter=self.name, stop_rule=stop_rule,
                                           generator=self.generator).result()
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
