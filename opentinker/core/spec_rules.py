"""The rules between a job spec's sections (the engine against the adapter, the placement against
the rollout): each a ValueError naming the field and why, raised while the spec is validated, so a
spec that cannot run fails before it is submitted."""

from __future__ import annotations

from typing import Any

from opentinker.core.model_names import VISION_MODELS


def check_placement(spec: Any) -> None:
    """ValueError for the first rule a JobSpec breaks (its sections validated already)."""
    lora, r, res = spec.adapter.kind == "lora", spec.rollout, spec.resources
    if not lora and r.weight_sync == "lora":
        raise ValueError("rollout.weight_sync: 'lora' moves a LoRA adapter; a full fine-tune (adapter.kind 'full') takes 'merged' (or 'auto')")
    if r.sampler_dtype != "auto" and r.engine not in ("vllm", "auto"):
        raise ValueError("rollout.sampler_dtype: only engine 'vllm' (or 'auto', where it chooses vllm) samples in a precision of its own")
    if r.engine == "server" and not lora:
        raise ValueError("rollout.engine: 'server' moves a LoRA adapter; a full fine-tune (adapter.kind 'full') samples with 'local' or 'vllm'")
    if r.engine in ("server", "vllm") and spec.multiagent is not None:
        raise ValueError("rollout.engine: self-play jobs sample with engine 'local'")
    if r.servers > 1 and (r.engine == "local" or r.server_url or res.share_base or spec.multiagent is not None):
        raise ValueError(f"rollout.servers: {r.servers} servers are the job's own inference servers (rollout.engine 'vllm', 'server' "
                         "naming no server_url, or 'auto'), not an in-process engine's, a shared base's or one server_url")
    if r.tensor_parallel > 1 and (r.engine not in ("vllm", "auto") or res.num_gpus < r.servers * r.tensor_parallel):
        raise ValueError(f"rollout.tensor_parallel: {r.tensor_parallel} GPUs a server is vLLM's tensor parallelism on GPUs: it needs "
                         f"rollout.engine 'vllm' (or 'auto') and resources.num_gpus at least servers x tensor_parallel = "
                         f"{r.servers * r.tensor_parallel} (the job has {res.num_gpus:g})")
    if res.share_base and (not lora or spec.model.init_from or spec.multiagent is not None or not res.colocate
                           or r.engine not in ("local", "auto")):
        raise ValueError("resources.share_base: only a LoRA job on a plain base (no model.init_from), colocated, sampling with "
                         "rollout.engine 'local' (or 'auto') and not self-play, trains as an adapter of a shared base-model worker")
    if spec.algorithm.max_staleness > 0 and (spec.multiagent is not None or res.share_base or r.engine == "server"):
        raise ValueError("algorithm.max_staleness: k > 0 is served for single-agent jobs sampling with rollout.engine 'local' or 'vllm' "
                         "on a base of their own")
    if res.trainer_ranks > 1 and (res.num_gpus or res.share_base or spec.multiagent or spec.model.name in VISION_MODELS):
        raise ValueError("resources.trainer_ranks: a sharded trainer trains one text model's policy in CPU processes for now (not on GPUs, a shared base, self-play or a VLM)")
    if spec.algorithm.advantage == "gae" and (res.trainer_ranks > 1 or res.share_base or spec.multiagent or spec.model.name in VISION_MODELS):
        raise ValueError("algorithm.advantage: 'gae' trains a critic beside one text model's policy in its process (not sharded, on a "
                         "shared base, self-play or a VLM)")
    if res.share_base and spec.optimization.compile:
        raise ValueError("optimization.compile: a shared base's modules serve every tenant's adapter, so a job on one "
                         "(resources.share_base) cannot compile them")
