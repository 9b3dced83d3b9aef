"""One adapter of a shared base (opentinker.backend.multi_lora) seen as a job's own peft model.

Why: a native LoRA job hosted on a base-model worker trains with the same code as a job with a
model of its own (PolicyTrainer, the sampler, checkpoints) but holds no copy of the base. What
that code asks of a peft model this gives, for the adapter only:
- `named_parameters()`: the adapter's tensors under peft's names (`…lora_A.default.weight`), so
  the optimizer, `trainable_state` and the checkpoint's weights are those of a peft job and a
  checkpoint loads either way;
- `get_base_model()`: the shared base, and `disable_adapter()`: the base alone (a LoRA job's KL
  reference);
- `save_pretrained(folder)`: a peft adapter folder (what serving and the registry read).

The base is not a submodule (its parameters are the worker's, frozen, never this job's; it stays
in eval mode for the other tenants; `train()` puts this adapter alone in training mode, so that its
LoRA dropout applies as in a peft job). A forward through the base uses this adapter only inside
`using()` (per thread: the hosted job's calls run inside it) or through this module's own
`forward`.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import nn

PEFT_PREFIX = "base_model.model."


class AdapterModel(nn.Module):
    def __init__(self, multi: Any, name: str, base_name: str):
        """`multi`: the base's MultiLora, which holds adapter `name`; `base_name`: the base model as the job names it."""
        super().__init__()
        self.multi, self.name, self.base_name = multi, name, base_name
        object.__setattr__(self, "lm", multi.model)  # not registered: see the module's docstring

    def using(self) -> AbstractContextManager[None]:
        """Every forward through the base in this block (this thread) uses this adapter."""
        return self.multi.only(self.name)

    def train(self, mode: bool = True) -> AdapterModel:
        """Training mode for this adapter alone: its LoRA dropout applies in its passes (the
        shared base stays in eval mode, which is every tenant's)."""
        super().train(mode)
        self.multi[self.name].training = mode
        return self

    @property
    def dropout_generator(self) -> torch.Generator | None:
        """Where this adapter's LoRA dropout masks are drawn from (its own, not the process's:
        the job's checkpoints keep it, opentinker.rl.policy)."""
        return self.multi[self.name].rng

    def disable_adapter(self) -> AbstractContextManager[None]:
        return self.multi.only(None)

    def get_base_model(self) -> nn.Module:
        return self.lm

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        with self.using():
            return self.lm(*args, **kwargs)

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True) -> Iterator[tuple[str, nn.Parameter]]:
        for path, (a, b) in self.multi[self.name].weights.items():
            yield f"{prefix}{PEFT_PREFIX}{path}.lora_A.default.weight", a
            yield f"{prefix}{PEFT_PREFIX}{path}.lora_B.default.weight", b

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        for _, p in self.named_parameters():
            yield p

    def save_pretrained(self, folder: str, **_: Any) -> None:
        self.multi.save(self.name, folder, self.base_name)

    @property
    def config(self) -> Any:
        return self.lm.config

    @property
    def generation_config(self) -> Any:
        return self.lm.generation_config

    @property
    def device(self) -> torch.device:
        return next(self.lm.parameters()).device
