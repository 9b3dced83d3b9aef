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


def autocast_lora_inputs(model, compute_dtype) -> None:
    """Under a reduced `compute_dtype`, leave each LoRA layer's input in it. peft casts the input to
    the adapter's float32 and autocast casts it straight back (bfloat16 -> float32 -> bfloat16 is
    exact): no number changes, and two copies of every activation per adapted projection go (the
    demo's bfloat16 update on a CPU took 2.34 s instead of 2.89 s, bench/cpu_precision.py)."""
    import torch
    from peft.tuners.tuners_utils import BaseTunerLayer

    if compute_dtype == torch.float32:
        return
    for module in model.modules():
        if isinstance(module, BaseTunerLayer):
            module.cast_input_dtype_enabled = False


def adapter_files(model, **save_options) -> dict[str, bytes]:
    """The LoRA adapter in peft's own layout (`adapter/…`), so a checkpoint loads with
    PeftModel.from_pretrained and vLLM serves it; `save_options` go to `save_pretrained`."""
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp, **save_options)
        return {f"adapter/{p.name}": p.read_bytes() for p in Path(tmp).iterdir() if p.is_file()}


def lora_factors(model) -> dict:
    """The policy's LoRA as low-rank factors per adapted weight, named as the base checkpoint names
    that weight: `<name>.lora_A` (r x in) and `<name>.lora_B` (out x r, its scaling folded in), so
    that W + B @ A is the merged weight. What a vLLM server merges into its own base weights to take
    a new policy version in place (opentinker.inference.vllm_worker): megabytes to move, where the
    merged model is the whole of it, and no LoRA path to pay at decode. Only a LoRA's factors train
    (a job that trains other weights too is refused: they would not reach the server)."""
    import torch

    others = [n for n, p in model.named_parameters() if p.requires_grad and ".lora_A." not in n and ".lora_B." not in n]
    if others:
        raise ValueError(f"the merged weight sync carries LoRA factors only, and this policy trains {others[0]} too")
    out = {}
    with torch.no_grad():
        for name, module in model.named_modules():
            if not (hasattr(module, "base_layer") and hasattr(module, "lora_A")):
                continue
            active = [a for a in module.active_adapters if a in module.lora_A]
            if not active:
                continue
            weight = name.removeprefix("base_model.model.") + ".weight"
            out[f"{weight}.lora_A"] = torch.cat([module.lora_A[a].weight for a in active]).cpu().contiguous()
            out[f"{weight}.lora_B"] = torch.cat([module.lora_B[a].weight * module.scaling[a] for a in active], dim=1).cpu().contiguous()
    return out


def policy_weights(model) -> dict:
    """A full fine-tune's weights by the names its checkpoint gives them, each tensor once (a tied
    output layer is the embedding's weight, named as the embedding): what a vLLM server loads in
    place of its own to take a new policy version (opentinker.inference.vllm_worker). All of them,
    trainable or not: a sampler's copy of the policy trains nothing itself."""
    import torch

    with torch.no_grad():
        return {name: p.detach().cpu().contiguous() for name, p in model.named_parameters()}
