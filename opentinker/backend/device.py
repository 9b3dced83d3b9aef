"""Where a job's model lives and in what precision.

A job's process uses the device Ray assigned it: CUDA device 0 of what it sees (Ray sets
CUDA_VISIBLE_DEVICES to the job's own GPUs) when the job holds GPUs, the CPU otherwise.
`model.dtype` is the compute precision: `auto` is bfloat16 on a GPU that supports it and on a CPU
with Intel AMX or AVX-512 BF16 (oneDNN multiplies bfloat16 matrices there 2-7x as fast as float32
ones, and the demo's update took 0.68x the float32 time on both kinds: bench/results/cpu_precision.md,
cpu_precision_epyc.md), float32 on other CPUs; the operator may fix what `auto` means on
the CPU with OPENTINKER_CPU_AUTO_DTYPE (the test suite fixes float32, so that its numbers do not
depend on which CPU runs it). Weights that are trained stay float32 (with the optimizer state), frozen weights (a
LoRA's base) are stored in the compute precision, and every forward pass runs under autocast in
it; log-probabilities and the loss are computed in float32 from the logits either way.

Tolerance of recomputed against sampling log-probabilities: 1e-4 in float32 (tested on CPU);
in bfloat16, sampling and training run the same autocast, so they agree to the bf16 rounding of
the logits, about 1e-2 (tested on CPU for bfloat16 as well).
"""

from __future__ import annotations

import functools
import logging
import math
import os
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch

log = logging.getLogger(__name__)
CPU_AUTO_ENV = "OPENTINKER_CPU_AUTO_DTYPE"

def check_gpus(num_gpus: float) -> None:
    """ValueError in one line when the job asks for more GPUs than torch sees here (it would
    otherwise train on the CPU without a word)."""
    if num_gpus <= 0:
        return
    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if have < math.ceil(num_gpus):
        raise ValueError(f"resources.num_gpus: the job asks for {num_gpus:g} GPU(s); this process sees {have} "
                         "(no CUDA device, or CUDA_VISIBLE_DEVICES hides them)")


@dataclass(frozen=True)
class Placement:
    device: torch.device
    compute_dtype: torch.dtype

    def weights_dtype(self, trained: bool) -> torch.dtype:
        """Trained weights in float32 (their optimizer state too); frozen ones in the compute precision.
        A float64 placement (the tests' exact reference) keeps everything in float64."""
        if trained:
            return torch.float64 if self.compute_dtype == torch.float64 else torch.float32
        return self.compute_dtype

    def autocast(self) -> Any:
        """The context every forward pass of the job runs in (sampling and training alike)."""
        if self.compute_dtype in (torch.float32, torch.float64):
            return nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.compute_dtype)


def compute_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype != "auto":
        return getattr(torch, dtype)
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float32
    return cpu_auto_choice()[0]


def cpu_bf16_unit() -> str | None:
    """The unit this CPU multiplies bfloat16 matrices with through oneDNN: "Intel AMX" (Sapphire
    Rapids and later Xeons), "AVX-512 BF16" (Cooper Lake, AMD Zen 4 and later), or None (AVX2,
    AVX-512 without BF16: bfloat16 would be emulated)."""
    if not (torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()):
        return None
    if getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)():
        return "Intel AMX"
    if getattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)():
        return "AVX-512 BF16"
    return None


@functools.cache
def cpu_auto_choice() -> tuple[torch.dtype, str]:
    """What `model.dtype: auto` computes in on this CPU, and why (logged once a process)."""
    forced = os.environ.get(CPU_AUTO_ENV, "")
    if forced:
        if forced not in ("float32", "bfloat16"):
            raise ValueError(f"{CPU_AUTO_ENV}={forced!r}: float32 or bfloat16 (or unset: bfloat16 where the CPU has AMX)")
        choice = getattr(torch, forced), f"{CPU_AUTO_ENV} is set"
    elif unit := cpu_bf16_unit():
        choice = torch.bfloat16, f"this CPU has {unit}; frozen weights bfloat16, what trains and its optimizer float32"
    else:
        choice = torch.float32, "no bfloat16 unit here (Intel AMX or AVX-512 BF16): bfloat16 would be emulated"
    log.info("model.dtype auto on the CPU: %s (%s)", str(choice[0]).removeprefix("torch."), choice[1])
    return choice


def precision_line(dtype: str, where: Placement) -> str:
    """How a job's passes compute, one line for its log: the precision and, where `auto` chose it, why."""
    chosen = str(where.compute_dtype).removeprefix("torch.")
    if dtype != "auto":
        return f"model.dtype {dtype} on the {where.device.type.upper()}"
    if where.device.type == "cpu":
        return f"model.dtype auto on the CPU: {chosen} ({cpu_auto_choice()[1]})"
    return f"model.dtype auto on the GPU: {chosen}"


def sampling_dtype(sampler_dtype: str, where: Placement) -> torch.dtype:
    """The precision a job's vLLM server samples in (`rollout.sampler_dtype`): its own, or the job's."""
    return where.compute_dtype if sampler_dtype == "auto" else getattr(torch, sampler_dtype)


def placement(num_gpus: float = 0, dtype: str = "auto") -> Placement:
    """The device and precision of a job asking for `num_gpus` GPUs (ValueError when there are none)."""
    check_gpus(num_gpus)
    device = torch.device("cuda", 0) if num_gpus > 0 else torch.device("cpu")
    return Placement(device, compute_dtype(dtype, device))


def cpu() -> Placement:
    return Placement(torch.device("cpu"), torch.float32)
