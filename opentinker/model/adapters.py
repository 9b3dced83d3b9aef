"""Which weights a job trains: a LoRA adapter (peft) on a frozen base, or the whole model."""

from __future__ import annotations

from opentinker.core.spec import FullSpec, LoraSpec


def wrap_model(model, adapter: LoraSpec | FullSpec):
    """Apply the adapter choice: a peft LoRA model (base frozen) or the full model trainable. For
    a vision-language model LoRA goes on the language model only, and `vision_tower` says what of
    the vision side trains too: nothing, the connector, or the encoder and the connector."""
    from opentinker.model.vision import connector_parameters, encoder_parameters, language_modules

    if isinstance(adapter, LoraSpec):
        from peft import LoraConfig, get_peft_model

        config = LoraConfig(
            r=adapter.r,
            lora_alpha=adapter.alpha,
            lora_dropout=adapter.dropout,
            target_modules=language_modules(model, adapter.target_modules),
            task_type="CAUSAL_LM",
        )
        wrapped = get_peft_model(model, config)
    else:
        wrapped = model
        for p in model.parameters():
            p.requires_grad_(True)
    for p in encoder_parameters(model):
        p.requires_grad_(adapter.vision_tower == "trainable")
    for p in connector_parameters(model):
        p.requires_grad_(adapter.vision_tower != "frozen")
    return wrapped


def adapter_files(model, **save_options) -> dict[str, bytes]:
    """The LoRA adapter in peft's own layout (`adapter/…`), so a checkpoint loads with
    PeftModel.from_pretrained and vLLM serves it; `save_options` go to `save_pretrained`."""
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp, **save_options)
        return {f"adapter/{p.name}": p.read_bytes() for p in Path(tmp).iterdir() if p.is_file()}


def merged_weights(model) -> dict:
    """The policy as a plain model's weights, named as its Hugging Face checkpoint names them: a
    LoRA's low-rank update merged into each layer it adapts (W + scaling · B A), the rest as is;
    a full model's own. What a vLLM server reloads in place of its weights (no LoRA path to pay
    at decode); the model itself is left unchanged."""
    import torch

    lora = {name: module for name, module in model.named_modules() if hasattr(module, "base_layer") and hasattr(module, "lora_A")}
    out = {}
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".lora_" in name:
                continue
            owner, _, leaf = name.rpartition(".base_layer.")
            if owner in lora and leaf == "weight":
                module = lora[owner]
                param = param + sum(module.lora_B[a].weight @ module.lora_A[a].weight * module.scaling[a] for a in module.active_adapters)
            out[name.removeprefix("base_model.model.").replace(".base_layer.", ".")] = param.detach().contiguous()
    return out
