"""Many LoRA adapters on one frozen base model, in one batch: each row of a forward (and backward)
pass uses its own adapter.

Why: tenants that train LoRA adapters of the same base need not hold a copy of the base each.
One `MultiLora` holds the base once and any number of named adapters (ranks may differ), each with
its own weights, optimizer (AdamW over its own parameters only), step count and dropout RNG.

How: every target `nn.Linear` of the base (q/k/v/o, gate/up/down by default) is replaced by a
`MultiLoraLinear` holding the same weight. A call names each row's adapter (`with multi.rows(["a", None, "b"]): model(...)`,
None = the base alone); the wrapper computes the base output once for the whole batch, then for
each adapter present gathers that adapter's rows, computes `scale * B (A x)` for them and adds it
back at those rows (`index_add`): segmented LoRA matmuls, one pair of small matmuls per adapter
and layer, whatever the row order. Outside `rows(...)` the model is the plain base (a reference
policy for free).

Isolation: the base's parameters are frozen and never part of an optimizer. An adapter's delta is
computed from, and added to, its own rows only, and rows never mix in a causal LM, so a loss
summed over rows gives each adapter exactly the gradient of its own rows' loss; an adapter with
no row in the batch is not in the autograd graph at all (its grads stay as they were).

Memory per adapter: r * (in + out) float32 values per target linear (the weights), the same again
for their grads, and twice that for AdamW's moments; activations are the batch's.

Adapters import from and export to peft's folder layout (adapter_config.json +
adapter_model.safetensors), so checkpoints, `PeftModel.from_pretrained` and vLLM read them.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from opentinker.backend.packed_linear import PackedLinear

DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_PEFT_PREFIX = "base_model.model."


@dataclass
class Adapter:
    """One tenant's LoRA: per wrapped linear (by module path) the pair (A [r, in], B [out, r]);
    the output gains `scale * B A x`. Its optimizer, if any, holds only these parameters."""

    name: str
    r: int
    alpha: float
    target_modules: tuple[str, ...]
    weights: dict[str, tuple[nn.Parameter, nn.Parameter]]
    dropout: float = 0.0
    use_rslora: bool = False
    optimizer: torch.optim.Optimizer | None = None
    steps: int = 0
    rng: torch.Generator | None = field(default=None, repr=False)
    # Its job is in a training pass: its dropout applies (the base's own train/eval mode is every
    # tenant's, and the shared base stays in eval mode).
    training: bool = False

    @property
    def scale(self) -> float:
        return self.alpha / (math.sqrt(self.r) if self.use_rslora else self.r)

    def parameters(self) -> list[nn.Parameter]:
        return [p for pair in self.weights.values() for p in pair]

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def step(self) -> None:
        """Apply this adapter's optimizer to its accumulated grads, then clear them."""
        if self.optimizer is None:
            raise RuntimeError(f"adapter {self.name!r} has no optimizer")
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.steps += 1

    def drop(self, x: torch.Tensor) -> torch.Tensor:
        """Dropout on the adapter's input with the adapter's own generator, so what a tenant
        draws does not depend on who else is in the batch."""
        keep = torch.empty_like(x).bernoulli_(1 - self.dropout, generator=self.rng)
        return x * keep / (1 - self.dropout)


@dataclass(frozen=True)
class _Grouped:
    """Rows gathered adapter by adapter into equal groups of `width` (shorter groups padded by
    repeating a row): `index` [N * width] rows; `keep` [N * width] 1.0, or 0.0 for the padding
    (None: no padding); `in_order`: the batch is already those groups (index = 0, 1, 2, ...)."""

    adapters: tuple[Adapter, ...]
    index: torch.Tensor
    keep: torch.Tensor | None
    width: int
    in_order: bool


@dataclass(frozen=True)
class _Rows:
    owner: object  # which MultiLora the assignment is for (several bases may live in a process)
    size: int | None  # None: every row of any batch goes through the one adapter of `segments` (see MultiLora.only)
    segments: tuple[tuple[Adapter, torch.Tensor], ...]  # (adapter, its row indices)
    grouped: _Grouped | None = None  # the same rows for batched matmuls, when it pays (see grouped_rows)


def grouped_rows(segments: tuple[tuple[Adapter, torch.Tensor], ...], size: int) -> _Grouped | None:
    """With two adapters or more, their deltas are two batched matmuls (`bmm`) per linear instead
    of two matmuls per adapter: about five tensor operations per linear whatever the number of
    adapters, where the per-adapter loop takes five per adapter (on a CPU each costs ~10 µs, as
    much as the matmul at decode's few rows). Not when padding the groups to one width would add
    more than half the rows again, nor with dropout (drawn per adapter, see Adapter.drop). One
    adapter takes it only for the whole batch (viewed, and its stacks kept while sampling). `size`:
    the batch's rows (rows of the base alone included)."""
    if not segments or any(adapter.dropout for adapter, _ in segments):
        return None
    if len(segments) == 1 and len(segments[0][1]) != size:  # one adapter beside base rows: the loop gathers less
        return None
    width = max(len(index) for _, index in segments)
    total = sum(len(index) for _, index in segments)
    if width * len(segments) > 1.5 * total:
        return None
    index, keep = [], []
    for _, rows in segments:
        n = len(rows)
        index.append(torch.cat([rows, rows[:1].expand(width - n)]))
        keep.append(torch.cat([torch.ones(n), torch.zeros(width - n)]))
    index = torch.cat(index)
    padded = width * len(segments) > total
    return _Grouped(tuple(a for a, _ in segments), index, torch.cat(keep).to(index.device) if padded else None, width,
                    not padded and len(index) == size and bool((index == torch.arange(size, device=index.device)).all()))


_ROWS: ContextVar[_Rows | None] = ContextVar("opentinker_multi_lora_rows", default=None)


class MultiLoraLinear(PackedLinear):
    """A frozen linear plus, per row, the delta of that row's adapter (read from `rows(...)`).
    It takes over the base linear's own weight and bias, so the model's parameter names and
    state_dict stay those of the base (its checkpoints, weight tying) and it is still an nn.Linear
    (a PackedLinear: sampling engines on the base multiply with a packed copy, see packed_linear)."""

    def __init__(self, base: nn.Linear, path: str, owner: object):
        super().__init__(base)
        self.path = path
        self._owner = owner
        self._stacked: tuple | None = None  # (adapters' tensors and versions, A stack, B stack) kept while sampling

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base_output(x)
        rows = _ROWS.get()
        if rows is None or rows.owner is not self._owner:
            return out
        if rows.size is None:
            return self._whole_batch_delta(x, out, rows.segments[0][0]) if rows.segments else out
        if x.shape[0] != rows.size:
            raise ValueError(f"{self.path}: batch of {x.shape[0]} rows, but rows(...) named {rows.size}")
        grouped = rows.grouped
        if grouped is not None and all(self.path in adapter.weights for adapter in grouped.adapters):
            return self._grouped_delta(x, out, grouped)
        for adapter, index in rows.segments:
            if self.path in adapter.weights:
                out = out.index_add(0, index, self._delta(adapter, x.index_select(0, index)).to(out.dtype))
        return out

    def _whole_batch_delta(self, x: torch.Tensor, out: torch.Tensor, adapter: Adapter) -> torch.Tensor:
        return out + self._delta(adapter, x).to(out.dtype) if self.path in adapter.weights else out

    def _delta(self, adapter: Adapter, xs: torch.Tensor) -> torch.Tensor:
        """`scale * B (A x)` of `adapter` for the rows `xs` (dropout on its input while training)."""
        a, b = adapter.weights[self.path]
        xs = xs.to(a.dtype)
        if adapter.dropout and (adapter.training or self.training):
            xs = adapter.drop(xs)
        return F.linear(F.linear(xs, a), b) * adapter.scale

    def _grouped_delta(self, x: torch.Tensor, out: torch.Tensor, grouped: _Grouped) -> torch.Tensor:
        """`out` plus every row's delta through two batched matmuls over the adapters' stacked A
        and B. A batch already in its groups is viewed, not gathered and scattered."""
        a_stack, b_stack = self._stacks(grouped.adapters)
        n, inner = len(grouped.adapters), x.shape[-1]
        xs = x if grouped.in_order else x.index_select(0, grouped.index)
        delta = torch.bmm(torch.bmm(xs.to(a_stack.dtype).reshape(n, -1, inner), a_stack.transpose(1, 2)), b_stack.transpose(1, 2))
        delta = delta.reshape(n * grouped.width, *x.shape[1:-1], -1)
        if grouped.in_order:
            return out + delta.to(out.dtype)
        if grouped.keep is not None:  # (the float32 mask after the cast made a bf16 base's index_add fail)
            delta = delta * grouped.keep.reshape(-1, *([1] * (x.dim() - 1))).to(delta.dtype)
        return out.index_add(0, grouped.index, delta.to(out.dtype))

    def _stacks(self, adapters: tuple[Adapter, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        """The adapters' A [N, r, in] and scale * B [N, out, r] for this linear (smaller ranks
        padded with zeros, which add exact zeros). Without grad (sampling) they are kept until an
        adapter's tensors change or another set of adapters comes: a decode step reuses them."""
        pairs = [adapter.weights[self.path] for adapter in adapters]
        key = [(t, t._version) for pair in pairs for t in pair]
        cached = None if torch.is_grad_enabled() else self._stacked
        if cached is not None and len(cached[0]) == len(key) and all(t is u and v == w for (t, v), (u, w) in zip(cached[0], key)):
            return cached[1], cached[2]
        rank = max(a.shape[0] for a, _ in pairs)
        a_stack = torch.stack([a if a.shape[0] == rank else F.pad(a, (0, 0, 0, rank - a.shape[0])) for a, _ in pairs])
        b_stack = torch.stack([(b if b.shape[1] == rank else F.pad(b, (0, rank - b.shape[1]))) * adapter.scale
                               for (_, b), adapter in zip(pairs, adapters)])
        if not torch.is_grad_enabled():
            self._stacked = (key, a_stack, b_stack)
        return a_stack, b_stack


class MultiLora:
    """A frozen base causal LM shared by named LoRA adapters. `model` stays the model to call:
    `with multi.rows(names): model(...)` (or `multi(names, **inputs)`)."""

    def __init__(self, model: nn.Module, targets: Sequence[str] = DEFAULT_TARGETS):
        self.model = model
        self.adapters: dict[str, Adapter] = {}
        self._owner = object()
        if any(isinstance(m, MultiLoraLinear) for m in model.modules()):
            raise ValueError("the model is shared by a MultiLora already")
        model.requires_grad_(False)
        self.linears: dict[str, MultiLoraLinear] = {}
        for path, module in list(model.named_modules()):
            if type(module) in (nn.Linear, PackedLinear) and path.rsplit(".", 1)[-1] in targets:
                wrapper = MultiLoraLinear(module, path, self._owner)
                model.set_submodule(path, wrapper)
                self.linears[path] = wrapper
        if not self.linears:
            raise ValueError(f"no nn.Linear named one of {list(targets)} in the model")

    # -- adapters ---------------------------------------------------------------------------
    def add(self, name: str, r: int = 16, alpha: float = 32.0, target_modules: Sequence[str] | None = None,
            dropout: float = 0.0, use_rslora: bool = False, seed: int = 0, optimizer: dict[str, Any] | None = None) -> Adapter:
        """A new adapter initialised as peft does by default (A kaiming-uniform, B zeros), drawn
        from `seed` alone. `optimizer`: AdamW keyword arguments (e.g. {"lr": 1e-4}), or None."""
        targets = tuple(target_modules or DEFAULT_TARGETS)
        gen = torch.Generator().manual_seed(seed)
        weights = {}
        for path in self.target_paths(targets):
            base = self.linears[path]
            a = torch.empty(r, base.in_features)
            nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=gen)
            weights[path] = (a, torch.zeros(base.out_features, r))
        return self._register(name, r, alpha, targets, weights, dropout, use_rslora, seed, optimizer)

    def remove(self, name: str) -> Adapter:
        return self.adapters.pop(name)

    def __getitem__(self, name: str) -> Adapter:
        return self.adapters[name]

    def __contains__(self, name: str) -> bool:
        return name in self.adapters

    def target_paths(self, targets: Sequence[str]) -> list[str]:
        paths = [p for p in self.linears if p.rsplit(".", 1)[-1] in targets]
        missing = set(targets) - {p.rsplit(".", 1)[-1] for p in paths}
        if missing:
            raise ValueError(f"target modules {sorted(missing)} are not wrapped here (wrapped: {sorted({p.rsplit('.', 1)[-1] for p in self.linears})})")
        return paths

    def _register(self, name, r, alpha, targets, weights, dropout, use_rslora, seed, optimizer) -> Adapter:
        if name in self.adapters:
            raise ValueError(f"adapter {name!r} exists already")
        if not 0 <= dropout < 1:
            raise ValueError(f"dropout {dropout} (0 <= dropout < 1)")
        device = next(self.model.parameters()).device
        params = {p: (nn.Parameter(a.to(device, torch.float32)), nn.Parameter(b.to(device, torch.float32))) for p, (a, b) in weights.items()}
        adapter = Adapter(name, r, float(alpha), targets, params, dropout, use_rslora,
                          rng=torch.Generator(device=device).manual_seed(seed + 1))
        if optimizer is not None:
            adapter.optimizer = torch.optim.AdamW(adapter.parameters(), **optimizer)
        self.adapters[name] = adapter
        return adapter

    # -- batches ----------------------------------------------------------------------------
    @contextmanager
    def rows(self, names: Sequence[str | None]) -> Iterator[None]:
        """Within the block, row i of every batch through the model uses adapter `names[i]`
        (None: the base alone). The assignment is fixed on entry (an adapter removed meanwhile
        still serves this block) and is per thread/task (a ContextVar)."""
        unknown = sorted({n for n in names if n is not None and n not in self.adapters})
        if unknown:
            raise KeyError(f"unknown adapters: {unknown}")
        device = next(self.model.parameters()).device
        groups: dict[str, list[int]] = {}
        for i, n in enumerate(names):
            if n is not None:
                groups.setdefault(n, []).append(i)
        segments = tuple((self.adapters[n], torch.tensor(ix, device=device)) for n, ix in groups.items())
        token = _ROWS.set(_Rows(self._owner, len(names), segments, grouped_rows(segments, len(names))))
        try:
            yield
        finally:
            _ROWS.reset(token)

    @contextmanager
    def only(self, name: str | None) -> Iterator[None]:
        """Within the block (this thread/task), every row of every batch uses adapter `name`
        (None: the base alone), whatever the batch's size: one job's adapter seen as its own model
        (opentinker.backend.adapter_model)."""
        if name is not None and name not in self.adapters:
            raise KeyError(f"unknown adapter: {name!r}")
        segments = ((self.adapters[name], None),) if name is not None else ()
        token = _ROWS.set(_Rows(self._owner, None, segments))
        try:
            yield
        finally:
            _ROWS.reset(token)

    def __call__(self, names: Sequence[str | None], **inputs):
        with self.rows(names):
            return self.model(**inputs)

    # -- peft layout ------------------------------------------------------------------------
    def peft_state(self, name: str, adapter_name: str | None = None) -> dict[str, torch.Tensor]:
        """The adapter's tensors under peft's names (CPU copies): as in adapter_model.safetensors,
        or with `adapter_name` (e.g. "default") as in a peft model's named_parameters (what the
        trainer's weights.safetensors holds)."""
        mid = f".{adapter_name}" if adapter_name else ""
        out = {}
        for path, (a, b) in self.adapters[name].weights.items():
            out[f"{_PEFT_PREFIX}{path}.lora_A{mid}.weight"] = a.detach().to("cpu", copy=True).contiguous()
            out[f"{_PEFT_PREFIX}{path}.lora_B{mid}.weight"] = b.detach().to("cpu", copy=True).contiguous()
        return out

    def save(self, name: str, folder: str | Path, base_model: str | None = None) -> Path:
        """Write the adapter as a peft folder (adapter_config.json + adapter_model.safetensors)."""
        from peft import LoraConfig
        from safetensors.torch import save_file

        adapter = self.adapters[name]
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        LoraConfig(r=adapter.r, lora_alpha=adapter.alpha, lora_dropout=adapter.dropout, use_rslora=adapter.use_rslora,
                   target_modules=list(adapter.target_modules), task_type="CAUSAL_LM",
                   base_model_name_or_path=base_model).save_pretrained(str(folder))
        save_file(self.peft_state(name), str(folder / WEIGHTS_FILE))
        return folder

    def adapter_files(self, name: str, base_model: str | None = None) -> dict[str, bytes]:
        """The peft folder as checkpoint files (`adapter/…`), as opentinker.model.adapter_files gives."""
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:
            self.save(name, tmp, base_model)
            return {f"adapter/{p.name}": p.read_bytes() for p in Path(tmp).iterdir() if p.is_file()}

    def load(self, name: str, folder: str | Path, seed: int = 0, optimizer: dict[str, Any] | None = None) -> Adapter:
        """Register an adapter from a peft LoRA folder (JSON + safetensors; nothing is unpickled).
        Only plain LoRA on wrapped linears is taken; anything else is refused by name."""
        from safetensors.torch import load_file

        folder = Path(folder)
        config = json.loads((folder / CONFIG_FILE).read_text())
        refused = {k: config.get(k) for k in ("use_dora", "rank_pattern", "alpha_pattern", "modules_to_save", "layers_to_transform")
                   if config.get(k)}
        if config.get("peft_type", "LORA") != "LORA" or config.get("bias", "none") != "none" or refused:
            raise ValueError(f"{folder}: only plain LoRA adapters are supported (peft_type={config.get('peft_type')}, "
                             f"bias={config.get('bias')}, {refused})")
        tensors = load_file(str(folder / WEIGHTS_FILE))
        weights: dict[str, list[torch.Tensor | None]] = {}
        for key, tensor in tensors.items():
            if not key.startswith(_PEFT_PREFIX) or not key.endswith((".lora_A.weight", ".lora_B.weight")):
                raise ValueError(f"{folder}: unexpected tensor {key}")
            path, which = key[len(_PEFT_PREFIX):-len(".lora_A.weight")], key[-len("A.weight")]
            if path not in self.linears:
                raise ValueError(f"{folder}: {path} is not a wrapped linear of this model")
            weights.setdefault(path, [None, None])["AB".index(which)] = tensor
        r = int(config["r"])
        for path, (a, b) in weights.items():
            base = self.linears[path]
            if a is None or b is None or a.shape != (r, base.in_features) or b.shape != (base.out_features, r):
                raise ValueError(f"{folder}: {path}: LoRA tensors missing or of the wrong shape for r={r}")
        targets = tuple(sorted({p.rsplit(".", 1)[-1] for p in weights}))
        return self._register(name, r, config.get("lora_alpha", 8), targets, {p: tuple(ab) for p, ab in weights.items()},
                              float(config.get("lora_dropout") or 0.0), bool(config.get("use_rslora")), seed, optimizer)
