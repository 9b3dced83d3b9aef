"""Runs inside vLLM's worker processes (`--worker-extension-cls`), in vLLM's environment: the one
piece of the project there, so it imports nothing but torch and safetensors.

`merge_lora_from(path)` takes a new policy version in place, between two engine steps: the file
the trainer wrote holds the LoRA's factors (opentinker.model.adapters.lora_factors, megabytes),
and the worker merges them into the base weights it reads from its own model folder (mapped, from
the page cache) and reloads the model with them. Decoding then pays nothing for the adapter (vLLM's
LoRA path decodes 3.3x slower on the CPU) and no merged model crosses a process boundary. Reached
through vLLM's `/collective_rpc` (its dev endpoints: the server is the job's own, on loopback).
"""

from __future__ import annotations


class WeightLoader:
    """Mixed into vLLM's worker class."""

    def merge_lora_from(self, path: str) -> int:
        """Reload the served model as its base weights plus the factors in `path`
        (`<weight>.lora_A`, `<weight>.lora_B`: W + B @ A, computed in float32 and served in the
        server's dtype); how many weights the factors changed. Every weight is reloaded (vLLM
        repacks a layer only once all of its weights have arrived)."""
        from pathlib import Path

        import torch
        from safetensors import safe_open
        from safetensors.torch import load_file

        factors = load_file(path)
        folder = Path(self.vllm_config.model_config.model)
        merged = 0

        def weights():
            nonlocal merged
            for file in sorted(folder.glob("*.safetensors")):
                with safe_open(str(file), "pt") as checkpoint:
                    for name in checkpoint.keys():  # noqa: SIM118 - safe_open has no __iter__
                        weight = checkpoint.get_tensor(name)
                        if f"{name}.lora_A" in factors:
                            weight = weight.float() + factors[f"{name}.lora_B"].float() @ factors[f"{name}.lora_A"].float()
                            merged += 1
                        yield name, weight

        with torch.no_grad():
            self.reload_weights(weights_iterator=weights(), is_checkpoint_format=True)
        if merged * 2 != len(factors):
            raise ValueError(f"{len(factors) // 2 - merged} of the factors' weights are not in {folder}")
        return merged
