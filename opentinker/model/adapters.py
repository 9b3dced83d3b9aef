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
