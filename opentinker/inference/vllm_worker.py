"""Runs inside vLLM's worker processes (`--worker-extension-cls`), in vLLM's environment: the one
piece of the project there, so it imports nothing but torch and safetensors.

`load_policy_from(path)` takes a new policy version in place, between two engine steps. The file
the trainer wrote holds either the LoRA's factors (opentinker.model.adapters.lora_factors,
megabytes), which the worker merges into the base weights it reads from its own model folder
(mapped, from the page cache), or a full fine-tune's weights (policy_weights), which replace them.
Decoding then pays nothing for an adapter (vLLM's LoRA path decodes 3.3x slower on the CPU) and no
merged model crosses a process boundary. Reached through vLLM's `/collective_rpc` (its dev
endpoints: the server is the job's own, on loopback).
"""

from __future__ import annotations

import logging


# Layers vLLM's in-place reload reports as "Failed to load weights" on every sync, wrongly: a rotary
# embedding's cos/sin cache is computed, never in a checkpoint, and a tied output layer shares the
# embedding's weight (repacked by `_repack_tied_head`). vLLM puts their tensors back as they were,
# which is right; the warning read as an error in every job's log, so only these two are silenced.
EXPECTED_UNLOADED = ("RotaryEmbedding", "ParallelLMHead")


def _expected(record) -> bool:
    return not (record.msg == "%s: Failed to load weights" and record.args and record.args[0] in EXPECTED_UNLOADED)


class WeightLoader:
    """Mixed into vLLM's worker class."""

    def policy_stamp(self) -> list:
        """[version, stamp] of the last load (None, None before any; a load without them: None, "unstamped")."""
        return list(getattr(self, "_opentinker_stamp", (None, None)))

    def load_policy_from(self, path: str, version: int | None = None, stamp: str | None = None) -> int:
        """Reload the served model as its base weights with what `path` holds: a weight of the same
        name replaces the base's, LoRA factors (`<weight>.lora_A`, `<weight>.lora_B`) add
        B @ A to it (in float32, served in the server's dtype); how many weights changed. Every
        weight is reloaded (vLLM repacks a layer only once all of its weights have arrived).
        `path` must be a file directly in the job's weights folder; the load is stamped (see above)."""
        import os
        from pathlib import Path

        import torch
        from safetensors import safe_open
        from safetensors.torch import load_file

        allowed = os.environ.get("OPENTINKER_WEIGHTS_DIR")
        file = Path(path)
        if not allowed or file.is_symlink() or file.resolve().parent != Path(allowed).resolve():
            raise PermissionError(f"{path}: this server loads weights only from its job's own folder")
        self._opentinker_stamp = (None, "unstamped")  # until this load completes as the trainer's
        given = load_file(str(file))
        folder = Path(self.vllm_config.model_config.model)
        changed: set[str] = set()

        def weights():
            for file in sorted(folder.glob("*.safetensors")):
                with safe_open(str(file), "pt") as checkpoint:
                    for name in checkpoint.keys():  # noqa: SIM118 - safe_open has no __iter__
                        if name in given:
                            weight = given[name]
                        elif f"{name}.lora_A" in given:
                            base = checkpoint.get_tensor(name)
                            weight = base.float() + given[f"{name}.lora_B"].float() @ given[f"{name}.lora_A"].float()
                        else:
                            yield name, checkpoint.get_tensor(name)
                            continue
                        changed.add(name)
                        yield name, weight

        reload_log = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
        if _expected not in reload_log.filters:
            reload_log.addFilter(_expected)
        with torch.no_grad():
            self.reload_weights(weights_iterator=weights(), is_checkpoint_format=True)
            self._repack_tied_head()
        unknown = {key.removesuffix(".lora_A").removesuffix(".lora_B") for key in given} - changed
        if unknown:
            raise ValueError(f"{len(unknown)} of the given weights are not in {folder}: {sorted(unknown)[:3]}")
        self._opentinker_stamp = (version, stamp or "unstamped")
        return len(changed)

    def _repack_tied_head(self) -> None:
        """A tied output layer shares its weight with the embedding, so the reload never loads it
        and never repacks it: on a CPU its packed copy for the GEMM kept the old embedding (4e-3 off
        on the probe once a full fine-tune moved the embedding). Repack it from the new weight."""
        model = self.model_runner.get_model()
        head = getattr(model, "lm_head", None)
        embed = getattr(getattr(model, "model", None), "embed_tokens", None)
        if head is not None and embed is not None and getattr(head, "weight", None) is getattr(embed, "weight", None):
            head.quant_method.process_weights_after_loading(head)
