"""Where a job's model lives and in what precision.

A job's process uses the device Ray assigned it: CUDA device 0 of what it sees (Ray sets
CUDA_VISIBLE_DEVICES to the job's own GPUs) when the job holds GPUs, the CPU otherwise.
`model.dtype` is the compute precision: `auto` is bfloat16 on a GPU that supports it and float32
on the CPU. Weights that are trained stay float32 (with the optimizer state), frozen weights (a
LoRA's base) are stored in the compute precision, and every forward pass runs under autocast in
it; log-probabilities and the loss are computed in float32 from the logits either way.

Tolerance of recomputed against sampling log-probabilities: 1e-4 in float32 (tested on CPU);
in bfloat16, sampling and training run the same autocast, so they agree to the bf16 rounding of
the logits, about 1e-2 (tested on CPU for bfloat16 as well).
"""

from __future__ import annotations

import math
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch


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
        """Trained weights in float32 (their optimizer state too); frozen ones in the compute precision."""
        return torch.float32 if trained else self.compute_dtype

    def autocast(self) -> Any:
        """The context every forward pass of the job runs in (sampling and training alike)."""
        if self.compute_dtype == torch.float32:
            return nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.compute_dtype)


def compute_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype != "auto":
        return getattr(torch, dtype)
    if device.type == "cuda" and torch.cuda.is_bf16_supported():
        return torch.bfloat16
    return torch.float32


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
