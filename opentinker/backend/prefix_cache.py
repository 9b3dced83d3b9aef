"""Key/value states of token sequences a rollout engine already ran, reused on the next turn.

Why: a multi-turn episode's next prompt is its record so far (prompt + sampled tokens) plus an
observation delta, and the record is append-only. Without reuse every turn prefills the whole
conversation again, which dominates multi-turn rollouts on CPU (a Gomoku turn re-reads ~1000
tokens to write 8). With it, a turn prefills only the tokens added since the last one.

Entries are exact: an entry is the KV of one sequence of token ids, used only for a prompt that
starts with exactly that sequence. They are valid for one set of weights: the cache empties itself
whenever any parameter of the model changed since it was filled (torch bumps a tensor's version
counter on every in-place write: optimizer steps, loaded or synced weights). Least recently used
entries go first once the cache holds more than `max_tokens` tokens; 0 turns it off.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

# One sequence's states: per layer, (keys, values) shaped [kv_heads, tokens, head_dim].
LayerStates = list[tuple[torch.Tensor, torch.Tensor]]


class PrefixCache:
    def __init__(self, model, max_tokens: int = 65536):
        self.model = model
        self.max_tokens = max_tokens
        self._entries: OrderedDict[tuple[int, ...], LayerStates] = OrderedDict()
        self._tokens = 0
        self._weights_version: int | None = None
        self.hit_tokens = 0  # prompt tokens served from the cache (not prefilled again)

    def _check_weights(self) -> None:
        version = sum(p._version for p in self.model.parameters())
        if version != self._weights_version:
            self.clear()
            self._weights_version = version

    def clear(self) -> None:
        self._entries.clear()
        self._tokens = 0

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, prompts: list[list[int]]) -> list[tuple[int, LayerStates | None]]:
        """For each prompt, (n, states) of the longest cached sequence that is a strict prefix
        of it (at least one token is left to run), else (0, None). Used entries are taken out:
        the extended sequence is stored again after generation."""
        if not self.max_tokens:
            return [(0, None)] * len(prompts)
        self._check_weights()
        lengths = sorted({len(k) for k in self._entries}, reverse=True)
        found: list[tuple[int, LayerStates | None]] = []
        used: set[tuple[int, ...]] = set()
        for prompt in prompts:
            hit = (0, None)
            for n in lengths:
                if n < len(prompt) and (key := tuple(prompt[:n])) in self._entries:
                    hit = (n, self._entries[key])
                    used.add(key)
                    break
            found.append(hit)
        for key in used:
            self._tokens -= len(key)
            del self._entries[key]
        self.hit_tokens += sum(n for n, _ in found)
        return found

    def store(self, tokens: list[int], states: LayerStates) -> None:
        """Keep `states` for `tokens`. Called after the `lookup` of the same generate call, which
        checked the weights; they cannot change in between, so each row's store skips the check."""
        if not self.max_tokens or not tokens or len(tokens) > self.max_tokens:
            return
        key = tuple(tokens)
        if key in self._entries:
            self._tokens -= len(key)
        self._entries[key] = states
        self._entries.move_to_end(key)
        self._tokens += len(key)
        while self._tokens > self.max_tokens:
            old, _ = self._entries.popitem(last=False)
            self._tokens -= len(old)
