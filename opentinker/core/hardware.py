"""What this machine has, asked without torch (the control plane may have none)."""

from __future__ import annotations

import shutil
import subprocess


def detect_gpus() -> int:
    """GPUs on this machine, counted with nvidia-smi."""
    if not shutil.which("nvidia-smi"):
        return 0
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(1 for line in out.splitlines() if line.startswith("GPU "))
