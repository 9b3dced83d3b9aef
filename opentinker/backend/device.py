"""Where a job's model lives: the devices this process may use."""

from __future__ import annotations

import math


def check_gpus(num_gpus: float) -> None:
    """ValueError in one line when the job asks for more GPUs than torch sees here (it would
    otherwise train on the CPU without a word)."""
    if num_gpus <= 0:
        return
    import torch

    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if have < math.ceil(num_gpus):
        raise ValueError(f"resources.num_gpus: the job asks for {num_gpus:g} GPU(s); this process sees {have} "
                         "(no CUDA device, or CUDA_VISIBLE_DEVICES hides them)")
