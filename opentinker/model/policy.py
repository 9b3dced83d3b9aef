"""Trained policies: what a checkpoint's weights apply to (`policy.json`), and the policy rebuilt
from a checkpoint (its base model with the trained weights, a LoRA adapter merged)."""

from __future__ import annotations

import json

from opentinker.core.model_names import KNOWN_MODELS, is_resolvable
from opentinker.model.adapters import wrap_model
from opentinker.model.loading import load_base
from opentinker.storage import checkpoint as ckpt
from opentinker.storage.resolve import resolve_checkpoint

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
    import yaml

    fs, path = ckpt.url_to_fs(checkpoint_url)
    if not ckpt.is_complete(fs, path):
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


def load_policy(checkpoint_url: str, dtype: str | None = None):
    """(model, tokenizer, info): the checkpoint's base model with its trained weights applied
    (a LoRA adapter is merged), in eval mode. Follows `init_from` chains."""
    import torch

    from opentinker.core.spec import LoraSpec

    info = read_policy_info(checkpoint_url)
    model, tokenizer = load_model(info["base_model"], dtype or info["dtype"], init_from=info.get("init_from"))
    weights = ckpt.load_checkpoint(checkpoint_url).weights
    if info["adapter"].get("kind", "lora") == "lora":
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
    return load_base(name, dtype)
