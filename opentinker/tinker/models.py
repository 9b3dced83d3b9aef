"""The base models a Tinker client may name: what the operator serves, without a model hub.

The operator's names (`smollm2-135m-instruct`, the tiny test models), SmolLM2's Hub id as an alias
of the shipped copy (so tinker-cookbook code that names `HuggingFaceTB/SmolLM2-135M-Instruct`
works unchanged), and every model folder in the operator's model directory by its folder name.
A name anything else (a path, an unknown id) is refused before a session is touched.
"""

from __future__ import annotations

from pathlib import Path

from opentinker.core.model_names import SMOLLM2, SMOLVLM, TINY, TINY_VLM

ALIASES = {"HuggingFaceTB/SmolLM2-135M-Instruct": SMOLLM2}
TEXT_MODELS = (SMOLLM2, TINY)  # the vision-language ones take image chunks, which this API does not serve yet
NOT_SERVED = (SMOLVLM, TINY_VLM)


class UnknownModel(ValueError):
    pass


def _folders(models_folder: Path) -> list[str]:
    if not models_folder.is_dir():
        return []
    return sorted(p.name for p in models_folder.iterdir() if p.is_dir() and (p / "config.json").is_file())


def served_models(models_folder: Path) -> list[str]:
    return [*TEXT_MODELS, *ALIASES, *_folders(models_folder)]


def resolve_base(models_folder: Path, name: str) -> str:
    """The loader's name for a base model a client names (a known name, or a folder path in the
    operator's model directory); UnknownModel lists what is served."""
    if not isinstance(name, str) or not name:
        raise UnknownModel("base_model: missing")
    if name in TEXT_MODELS:
        return name
    if name in ALIASES:
        return ALIASES[name]
    if name in _folders(models_folder):
        return str(models_folder / name)
    raise UnknownModel(f"base_model {name[:200]!r} is not served here; served: {', '.join(served_models(models_folder))}")


def capabilities(models_folder: Path) -> dict:
    return {"supported_models": [{"model_name": name, "trainable": True, "sampleable": True}
                                 for name in served_models(models_folder)]}


def tokenizer_id(base_name: str, models_folder: Path) -> str:
    """What the SDK's get_tokenizer loads: a Hub id stays itself (the client's cache or registration),
    the operator's names point at the tokenizer folder on this machine."""
    if base_name in ALIASES:
        return base_name
    try:
        from opentinker.model.loading import resolve_model

        return str(resolve_model(resolve_base(models_folder, base_name)))
    except (UnknownModel, FileNotFoundError):
        return base_name
