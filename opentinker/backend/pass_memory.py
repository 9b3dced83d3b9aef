"""What one training pass costs in memory, so a shared worker sizes its passes to what it has.

Why: a base-model worker holds every tenant's adapters and samplers; one pass that outgrows the
memory left takes the worker down (Ray's memory monitor, or the GPU's allocator) and with it every
session on it. So a pass's size is chosen from the memory left, and a datum that cannot fit in any
pass is refused before it runs.

The rule (docs/tinker.md states it). A forward-backward over `t` tokens of a causal LM with L
layers, hidden size h and MLP size i, activations of s bytes, holds at its peak about

    pass_bytes(t) = CALIBRATION * t * L * (10 h + 4 i) * s  +  3 * min(t, HEAD_CHUNK_POSITIONS) * V * 4

(10 h + 4 i: the values a Llama-like layer keeps for its backward per token, the norms, the
attention's q/k/v/output, the MLP's gate, up and their product; the second term the head's
logits, their log-softmax and gradient for one chunk of positions, float32). CALIBRATION covers
the backward's transient gradients and the allocator: measured on SmolLM2-135M in float32 on a CPU
(bench/pass_memory.py: a 4,096-token pass added 12.8 GB, 2.1x the count), rounded up. Memory for
passes is PASS_SHARE of what the base and its adapters' training state leave of the worker's bound
(the rest: the samplers' key/value caches and their batches, which run beside a pass).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

CALIBRATION = 2.4
PASS_SHARE = 0.75
MIB = 2**20


@dataclass(frozen=True)
class PassMemory:
    """A base's per-token and per-chunk pass costs, in bytes."""

    per_token: float
    head: float  # one chunk of the head's logits, log-softmax and gradient
    head_chunk: int

    @classmethod
    def of(cls, config: Any, activation_bytes: int, head_chunk: int) -> PassMemory:
        """From a transformers config (its text config for a vision model)."""
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        layers, hidden = int(text.num_hidden_layers), int(text.hidden_size)
        mlp = int(getattr(text, "intermediate_size", None) or 4 * hidden)
        chunk = head_chunk or 4096
        return cls(per_token=CALIBRATION * layers * (10 * hidden + 4 * mlp) * activation_bytes,
                   head=3.0 * chunk * int(text.vocab_size) * 4, head_chunk=chunk)

    def pass_bytes(self, tokens: int) -> float:
        """The peak a pass over `tokens` padded positions adds, by the rule."""
        return self.per_token * tokens + self.head * min(tokens, self.head_chunk) / self.head_chunk

    def tokens_within(self, room: float) -> int:
        """The most padded positions a pass may hold in `room` bytes (0: not even one)."""
        full = self.pass_bytes(self.head_chunk)  # below a chunk, each position also pays its share of the head
        if room < full:
            return max(0, int(room // (self.per_token + self.head / self.head_chunk)))
        return self.head_chunk + int((room - full) // self.per_token)

    def refusal(self, lengths: list[int], room: float | None, base_name: str) -> str | None:
        """The one line for the longest datum when no pass of `room` bytes holds it (None: every datum fits)."""
        if room is None or not lengths:
            return None
        i = max(range(len(lengths)), key=lengths.__getitem__)
        if (need := self.pass_bytes(lengths[i])) <= room:
            return None
        return (f"data[{i}]: {lengths[i]} tokens need about {need / MIB:,.0f} MiB in a pass and the worker of {base_name} has "
                f"{max(room, 0) / MIB:,.0f} MiB for passes (docs/tinker.md, 'Pass memory'): send shorter datums, or ask the "
                f"operator for more worker memory")
