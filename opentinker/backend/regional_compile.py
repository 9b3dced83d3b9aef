"""Regional compilation: `torch.compile` on each decoder layer's MLP and RMS norms.

Why: on a GPU a step of a small model is bound by the host launching kernels one by one (an H200
ran the 1.5B shape's update with the device busy about a third of the time); compiling fuses each
region's element-wise work (norms, activation, the casts autocast adds) into a few kernels. Why
these regions and not whole layers: the attention updates the KV cache, whose per-layer state makes
a compiled layer recompile for every layer index (past torch's recompile limit). One compiled graph
serves every layer (same code, dynamic shapes); the first call of each kind (sampling, training)
pays the compile. Measured in bench/results/gpu_variants_full.md.
"""

from __future__ import annotations

REGIONS = ("mlp", "input_layernorm", "post_attention_layernorm")


def compile_regions(model) -> int:
    """Compile `model`'s regions in place (a peft wrapper's base included); how many modules.
    A model without decoder layers of that shape is left as it is (0)."""
    lm = model.get_base_model() if hasattr(model, "get_base_model") else model
    decoder = lm.get_decoder() if hasattr(lm, "get_decoder") else None
    layers = getattr(decoder, "layers", None) or []
    modules = [getattr(layer, name) for layer in layers for name in REGIONS if hasattr(layer, name)]
    for module in modules:
        module.compile(dynamic=True)
    return len(modules)
