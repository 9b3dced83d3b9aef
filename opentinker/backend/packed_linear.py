"""Frozen linears whose weights are pre-packed for oneDNN while a CPU engine samples.

Why: decoding runs the model on a few rows at a time, and on a CPU a float32 matmul of 8 rows
against a weight in its stored (row-major) layout reaches about 10 GB/s of the 26 the memory
gives. oneDNN's blocked layout for the same weight (what torch.compile's freezing pass packs on
CPUs) does the same float32 arithmetic, in another summation order, about 1.6x as fast: a
SmolLM2-135M decode step of 8 rows goes from 87 to 60 ms on the 2-core machine. The packed copy is
made lazily on first use and costs the weight's size again in memory.

The packed copy is used only under `torch.no_grad()` on the CPU (training and autograd keep
`F.linear` on the stored weight), and is made again when the weight changes: a new tensor or an
in-place change (its version counter) is noticed; an owner that rewrites a weight through `.data`
(peft's merge and unmerge do, which leaves the version as it was) calls `repack(model)`.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn


def available() -> bool:
    """Whether this torch has oneDNN's packed linear (CPU builds for x86 and ARM do)."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


@functools.cache
def packs(dtype: torch.dtype) -> bool:
    """Whether weights of `dtype` pack on this CPU: float32 always; bfloat16 only where oneDNN has
    a bf16 path (AVX-512 BW/VL/DQ or AVX-NE-CONVERT; an AVX2 CPU refuses the reorder)."""
    if dtype == torch.float32:
        return True
    return dtype == torch.bfloat16 and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


class PackedLinear(nn.Linear):
    """An nn.Linear that takes over another's weight and bias (parameter names, state_dict and
    weight tying unchanged) and, when packing is on, multiplies with a packed copy of the weight
    wherever that gives the same result: no grad, CPU, input in the weight's dtype."""

    def __init__(self, base: nn.Linear):
        nn.Module.__init__(self)
        self.training = base.training  # the mode of the module it replaces (a model in eval mode stays so)
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight, self.bias = base.weight, base.bias
        self.packing = False
        self._packed: torch.Tensor | None = None
        self._packed_key: tuple | None = None

    def base_output(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if (not self.packing or torch.is_grad_enabled() or x.device.type != "cpu"
                or x.dtype != w.dtype or not packs(w.dtype)):
            return F.linear(x, w, self.bias)
        key = (w.data_ptr(), w._version)
        packed = self._packed
        if packed is None or self._packed_key != key:  # two threads may pack at once: same result, one kept
            packed = torch.ops.mkldnn._reorder_linear_weight(w.detach(), 8)
            self._packed, self._packed_key = packed, key
        bias = self.bias.detach() if self.bias is not None else None
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base_output(x)

    def forget(self) -> None:
        self._packed, self._packed_key = None, None


def pack_linears(model: nn.Module) -> int:
    """Turn on packing for `model`'s linears (plain nn.Linear modules become PackedLinear;
    PackedLinear subclasses already there are switched on). Does nothing where oneDNN's packed
    linear is missing. Returns how many linears pack."""
    if not available():
        return 0
    count = 0
    for path, module in list(model.named_modules()):
        if type(module) is nn.Linear:
            module = PackedLinear(module)
            model.set_submodule(path, module)
        if isinstance(module, PackedLinear):
            module.packing = True
            count += 1
    return count


def repack(model: nn.Module) -> None:
    """Drop the packed copies (made again on next use): after weights were rewritten in place."""
    for module in model.modules():
        if isinstance(module, PackedLinear):
            module.forget()
