"""Runs inside vLLM's worker processes (`--worker-extension-cls`), in vLLM's environment: the one
piece of the project there, so it imports nothing but torch and safetensors.

`load_weights_from(path)` loads a safetensors file the trainer wrote (the policy's merged weights,
named as the Hugging Face model names them) into the served model, between two engine steps: the
way a job's new weights reach its vLLM server without going through vLLM's LoRA path (3.3x slower
to decode on the CPU). Reached through vLLM's `/collective_rpc` (its dev endpoints: the server is
the job's own, on loopback).
"""

from __future__ import annotations


class WeightLoader:
    """Mixed into vLLM's worker class."""

    def load_weights_from(self, path: str) -> int:
        """Reload the served model's weights from `path` (all of them, in the checkpoint's format:
        vLLM repacks them for its kernels as when it started); how many tensors."""
        from safetensors.torch import load_file

        weights = load_file(path)
        self.reload_weights(weights_iterator=iter(weights.items()), is_checkpoint_format=True)
        return len(weights)
