"""The critic of `algorithm.advantage: gae`: a value model trained beside the policy.

Which: a separate model, the job's base with a LoRA of its own and a linear value head on its last
hidden state, not a head on the policy's trunk. Why: the policy's update stays exactly what every
other estimator trains (the same loss, passes and tests; the Tinker door and the sharded trainer
untouched), and the value loss never pulls on the policy's features (a shared trunk needs its
value-loss weight tuned against the policy's). The cost is a second copy of the base (frozen, in
the compute precision: 270 MB for SmolLM2-135M in bfloat16, 540 MB in float32) and a forward and
backward over each distinct state per epoch. The head starts at zero, so the first values are 0
and the first advantages the discounted returns.

It values the state each turn acts from: the record up to the turn's first sampled token (the
piece's context, `Trajectory.split_by_turn`). `credit` computes the values, GAE's advantages and
returns (opentinker.algo.gae) and keeps them; `fit` then trains the critic on them with PPO's
clipped value loss, after the policy's step. Its state (LoRA, head, AdamW) travels in the job's
checkpoints (`state` / `load_state`), so a resumed job continues it exactly.
"""

from __future__ import annotations

import io

import torch

from opentinker.algo.gae import clipped_value_loss, gae, whiten
from opentinker.backend.device import Placement
from opentinker.core.spec import LoraSpec
from opentinker.core.trajectory import Trajectory
from opentinker.model import load_model, wrap_model

CRITIC_FILE = "critic.pt"  # in a checkpoint: the critic's trained tensors and its optimizer's state (tensors and numbers)


def job_critic(spec, where: Placement) -> "Critic":
    """The critic of a job (its spec's `algorithm.advantage: gae`): the job's base, frozen in the
    compute precision, with the job's LoRA shape (r 8 for a full fine-tune) and a value head, trained in float32."""
    base, _ = load_model(spec.model.name, spec.model.dtype)
    lora = spec.adapter if isinstance(spec.adapter, LoraSpec) else LoraSpec(r=8, alpha=16)
    model = wrap_model(base.to(dtype=where.weights_dtype(trained=False)), lora)
    for p in model.parameters():
        if p.requires_grad:
            p.data = p.data.to(where.weights_dtype(trained=True))
    return Critic(model, spec.algorithm, spec.optimization, where)


class Critic:
    def __init__(self, model: torch.nn.Module, algorithm, optimization, where: Placement):
        """`model`: the critic's own copy of the job's base, with its LoRA (opentinker.model.wrap_model)."""
        self.algorithm, self.optimization, self.where = algorithm, optimization, where
        self.model = model.to(where.device)
        lm = model.get_base_model() if hasattr(model, "get_base_model") else model
        self.decoder = getattr(lm, lm.base_model_prefix)  # the trunk without its vocabulary head
        self.pad = int(lm.config.pad_token_id if lm.config.pad_token_id is not None else 0)
        self.head = torch.nn.Linear(lm.config.hidden_size, 1, dtype=where.weights_dtype(trained=True), device=where.device)
        torch.nn.init.zeros_(self.head.weight)
        torch.nn.init.zeros_(self.head.bias)
        self.params = [p for p in self.model.parameters() if p.requires_grad] + list(self.head.parameters())
        self.optimizer = torch.optim.AdamW(self.params, lr=algorithm.critic_lr, weight_decay=0.0)
        self._kept: tuple[list[list[int]], torch.Tensor, torch.Tensor] | None = None

    # --- values ---------------------------------------------------------------------------------
    def values(self, contexts: list[list[int]]) -> torch.Tensor:
        """V(s) of each context (token ids), in micro-batches, with the graph (for `fit`)."""
        out = []
        size = self.optimization.micro_batch_size
        for start in range(0, len(contexts), size):
            part = contexts[start:start + size]
            lengths = torch.tensor([len(c) for c in part], device=self.where.device)
            ids = torch.full((len(part), int(lengths.max())), self.pad, dtype=torch.long, device=self.where.device)
            for i, c in enumerate(part):
                ids[i, :len(c)] = torch.tensor(c, dtype=torch.long)
            mask = (torch.arange(ids.shape[1], device=ids.device)[None, :] < lengths[:, None]).long()
            with self.where.autocast():
                hidden = self.decoder(input_ids=ids, attention_mask=mask).last_hidden_state
            last = hidden[torch.arange(len(part), device=ids.device), lengths - 1]
            out.append(self.head(last.to(self.head.weight.dtype)).squeeze(-1))
        return torch.cat(out) if out else torch.zeros(0)

    # --- credit ---------------------------------------------------------------------------------
    def credit(self, trajs: list[Trajectory]) -> tuple[list[Trajectory], torch.Tensor]:
        """(one sample per turn, in the records' order; GAE's advantage of each), whitened over the
        batch where `algorithm.normalize_std`. The values and returns are kept for `fit`."""
        a = self.algorithm
        pieces = [t.split_by_turn() for t in trajs]
        samples = [p for own in pieces for p in own]
        # each state runs once: a group's episodes share their prompt (its first turn's state), and the
        # loss over a state's samples is the same with one forward (the demo's 32 samples act from 8 states)
        contexts = [tuple(p.prompt_ids) for p in samples]
        row = {state: i for i, state in enumerate(dict.fromkeys(contexts))}
        states = [list(state) for state in row]
        of = torch.tensor([row[c] for c in contexts], dtype=torch.long)
        with torch.no_grad():
            values = self.values(states).double().cpu()[of]
        advantages, returns, at = [], [], 0
        for t, own in zip(trajs, pieces):
            rewards = [turn.reward for turn in t.turns] if len(own) == len(t.turns) and not t.failed else [t.reward]
            adv, ret = gae(rewards, values[at:at + len(own)].tolist(), a.gamma, a.gae_lambda)
            advantages += adv
            returns += ret
            at += len(own)
        self._kept = (states, of, values, torch.tensor(returns, dtype=torch.float64))
        advantages_t = torch.tensor(advantages, dtype=torch.float64)
        return samples, (whiten(advantages_t) if a.normalize_std else advantages_t).float()

    def fit(self) -> dict[str, float]:
        """Train the critic on the last `credit`'s returns: `critic_epochs` passes over its states
        in micro-batches, each an AdamW step on PPO's clipped value loss (clip `value_clip`), the
        mean over the samples that act from those states."""
        if self._kept is None:
            return {}
        states, of, old, returns = self._kept
        self._kept = None
        a, size, losses = self.algorithm, self.optimization.micro_batch_size, []
        spread = float(returns.var(unbiased=False))
        explained = 1.0 - float((returns - old).var(unbiased=False)) / spread if spread > 0 else 0.0  # of the returns, by the values
        self.model.train()
        for _ in range(a.critic_epochs):
            for start in range(0, len(states), size):
                mine = (of >= start) & (of < start + size)
                values = self.values(states[start:start + size])
                values = values[(of[mine] - start).to(values.device)]
                dtype, device = values.dtype, values.device
                loss = clipped_value_loss(values, old[mine].to(device, dtype), returns[mine].to(device, dtype), a.value_clip).mean()
                loss.backward()
                torch.nn.utils.clip_grad_norm_(self.params, self.optimization.grad_clip)
                self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=True)
                losses.append(loss.item())
        self.model.eval()
        return {"critic/value_loss": sum(losses) / len(losses), "critic/value_mean": float(old.mean()),
                "critic/return_mean": float(returns.mean()), "critic/explained_variance": explained}

    # --- checkpoints ----------------------------------------------------------------------------
    def _trained(self) -> dict[str, torch.Tensor]:
        named = {f"model.{n}": p for n, p in self.model.named_parameters() if p.requires_grad}
        return named | {f"head.{n}": p for n, p in self.head.named_parameters()}

    def state(self) -> bytes:
        """The critic's trained tensors and AdamW state, as a checkpoint's CRITIC_FILE."""
        buffer = io.BytesIO()
        torch.save({"weights": {n: p.detach().cpu() for n, p in self._trained().items()}, "optimizer": self.optimizer.state_dict()}, buffer)
        return buffer.getvalue()

    def load_state(self, data: bytes) -> None:
        """Back to a `state()` (loaded without running code: tensors and numbers only)."""
        state = torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")
        trained = self._trained()
        if set(state["weights"]) != set(trained):
            raise ValueError("the checkpoint's critic does not fit this job's (another model or adapter)")
        with torch.no_grad():
            for name, tensor in state["weights"].items():
                trained[name].copy_(tensor)
        self.optimizer.load_state_dict(state["optimizer"])
