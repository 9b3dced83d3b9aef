"""An SFT LoRA job on a shared base (`resources.share_base`): its adapter on the pool's base-model
worker, trained step by step by the flow's calls (opentinker.orchestration.base_worker).

Why not TRL here: `SFTTrainer` wants a model of its own. It patches the model's forward (its fused
LM head), sets train mode and tags on it, and would build its optimizer over every parameter that
wants a gradient — on a shared base, other tenants' adapters. So a hosted job runs the same
training as plain PyTorch through its adapter (opentinker.backend.adapter_model), on the examples,
mask and loss TRL uses:
- examples: the chat template applied with `return_assistant_tokens_mask` (the marked template of
  opentinker.sft.template when `assistant_only_loss`), the same validation as an own SFT job
  (SFTJob: data lines, template, lengths) before anything trains; an example with no trained token
  is dropped, as TRL drops it;
- loss: the summed negative log-likelihood of the trained tokens (shifted by one) over their count
  in the whole optimizer step (all its micro-batches), as TRL's `num_items_in_batch`;
- AdamW (lr, weight decay), transformers' schedule over the run's steps, the global norm clipped;
- a batch runs as passes of at most SHARED_PASS_TOKENS padded tokens, gradients accumulated (the same
  sums), so no tenant's batch size decides how much of the shared base's memory one pass takes;
- measured before and after as TRL's `evaluate` reports: per batch the token-mean loss, averaged
  over batches weighted by their examples; the token accuracy averaged over batches.
The order of the examples differs from TRL's sampler (a seeded shuffle per epoch), so a hosted job
does not reproduce an own job's run bit for bit; it reproduces itself whoever shares its worker.
The checkpoint has the layout of an own LoRA SFT job (peft's adapter, the optimizer's state).
"""

from __future__ import annotations

import json
import math
from typing import Any

import torch

from opentinker.backend.primitives import micro_batches, padded
from opentinker.model import POLICY_FILE, adapter_files, policy_info
from opentinker.sft.job import SFTJob, to_cpu
from opentinker.sft.spec import SFT_SPEC_FILE, SHARED_PASS_TOKENS, dump_sft_spec
from opentinker.storage import checkpoint as ckpt


class SharedSFT:
    """`begin()` (loss before), `step()` per optimizer step until `done`, `finish()` (loss after,
    checkpoint). `model`: the job's AdapterModel; every forward runs inside its `using()` (the caller's)."""

    def __init__(self, spec: Any, job_id: str, tenant: str | None, model: Any):
        self.data = SFTJob(spec, job_id, tenant, model=model)  # the same checks, data split and reuse as an own job
        self.spec, self.job_id, self.tenant, self.model = spec, self.data.job_id, tenant, model
        self.step_count, self.tokens, self.done = 0, 0, bool(self.data.reused)
        if self.done:
            return
        t = spec.training
        self.train_rows = self._encode(self.data.train_chats)
        self.eval_rows = self._encode(self.data.eval_chats)
        self.params = [p for _, p in model.named_parameters()]
        self.optimizer = torch.optim.AdamW(self.params, lr=t.lr, weight_decay=t.weight_decay)
        from transformers import get_scheduler

        self.max_steps = math.ceil(math.ceil(len(self.train_rows) / t.batch_size) / t.grad_accum) * t.epochs
        self.scheduler = get_scheduler(t.lr_scheduler, self.optimizer, num_warmup_steps=0, num_training_steps=self.max_steps)
        self.generator = torch.Generator().manual_seed(t.seed)  # the job's own: its order is the same whoever shares the worker
        self.batches = iter(())
        self.epoch = 0
        self.before: dict[str, float] = {}

    # -- data ---------------------------------------------------------------------------------
    def _encode(self, chats: list) -> list[tuple[list[int], list[int]]]:
        """(token ids, 1 where the token is trained) per example; examples with nothing to train are dropped."""
        tokenizer, only = self.data.tokenizer, self.spec.training.assistant_only_loss
        rows = []
        for _, messages in chats:
            out = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=only)
            mask = list(out["assistant_masks"]) if only else [1] * len(out["input_ids"])
            if 1 in mask:
                rows.append((list(out["input_ids"]), mask))
        return rows

    def _epoch_batches(self):
        """The step's micro-batches, epoch after epoch: a seeded shuffle, then `grad_accum` batches a step
        (an epoch's last step may have fewer)."""
        t = self.spec.training
        while self.epoch < t.epochs:
            order = torch.randperm(len(self.train_rows), generator=self.generator).tolist()
            batches = [[self.train_rows[i] for i in order[s:s + t.batch_size]] for s in range(0, len(order), t.batch_size)]
            for s in range(0, len(batches), t.grad_accum):
                yield batches[s:s + t.grad_accum]
            self.epoch += 1

    @staticmethod
    def passes(rows: list) -> list[list]:
        """`rows` grouped into passes of at most SHARED_PASS_TOKENS padded tokens (primitives.micro_batches):
        a batch's gradient is the sum of its passes', and the base's memory is spent on one pass at a time."""
        return [[rows[i] for i in group] for group in micro_batches([len(ids) for ids, _ in rows], SHARED_PASS_TOKENS)]

    def _nll(self, rows) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(summed NLL of the trained tokens, their count, how many the model's top-1 guessed); rows of one pass."""
        batch, attention = padded([{"tokens": torch.tensor(ids), "trained": torch.tensor(mask)} for ids, mask in rows], self.model.device)
        ids = batch["tokens"]
        logits = self.model(input_ids=ids, attention_mask=attention.long()).logits[:, :-1].float()
        targets, mask = ids[:, 1:], batch["trained"][:, 1:].bool()
        logp = torch.log_softmax(logits, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        right = (logits.argmax(-1) == targets) & mask
        return -(logp * mask).sum(), mask.sum(), right.sum()

    # -- the job's calls ----------------------------------------------------------------------
    def measure(self) -> dict[str, float]:
        """Loss and token accuracy on the held-out and the training examples (as TRL's evaluate)."""
        out: dict[str, float] = {}
        size = self.spec.training.batch_size
        with torch.no_grad():
            for name, rows in (("eval", self.eval_rows), ("train_set", self.train_rows)):
                losses, weights, accuracies = [], [], []
                for s in range(0, len(rows), size):
                    batch = rows[s:s + size]
                    nll, count, right = (sum(t) for t in zip(*(self._nll(p) for p in self.passes(batch))))
                    losses.append(float(nll / count.clamp(min=1)))
                    weights.append(len(batch))
                    accuracies.append(float(right / count.clamp(min=1)))
                if losses:
                    out[f"{name}/loss"] = sum(l * w for l, w in zip(losses, weights)) / sum(weights)
                    out[f"{name}/mean_token_accuracy"] = sum(accuracies) / len(accuracies)
        return out

    def begin(self) -> dict[str, Any]:
        """The loss before training, and how many optimizer steps the run will take."""
        if self.done:
            return {"reused": True, "done": True}
        self.before = self.measure()
        self.batches = self._epoch_batches()
        return {**self.before, "sft/max_steps": float(self.max_steps)}

    def step(self) -> dict[str, Any]:
        """One optimizer step; its metrics (at logging steps), `done` once the run's steps are taken."""
        micro = None if self.done else next(self.batches, None)
        if micro is None:
            self.done = True
            return {"done": True, "step": self.step_count, "metrics": {}}
        count = sum(sum(m[1:]) for batch in micro for _, m in batch)  # trained (shifted) tokens in the whole step
        lr = self.scheduler.get_last_lr()[0]
        self.optimizer.zero_grad(set_to_none=True)
        nll_sum, right_sum = 0.0, 0
        self.model.train()  # this adapter's LoRA dropout, as TRL trains an own job's
        try:
            for part in (p for batch in micro for p in self.passes(batch)):
                nll, _, right = self._nll(part)
                (nll / max(count, 1)).backward()
                nll_sum, right_sum = nll_sum + float(nll.detach()), right_sum + int(right)
        finally:
            self.model.eval()
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.params, self.spec.training.grad_clip))
        self.optimizer.step()
        self.scheduler.step()
        self.step_count += 1
        self.tokens += sum(len(ids) for batch in micro for ids, _ in batch)
        self.done = self.step_count >= self.max_steps
        metrics = {}
        if self.step_count % self.spec.training.logging_steps == 0 or self.done:
            metrics = {"sft/loss": nll_sum / max(count, 1), "sft/grad_norm": grad_norm, "sft/learning_rate": lr,
                       "sft/mean_token_accuracy": right_sum / max(count, 1), "sft/num_tokens": float(self.tokens),
                       "sft/epoch": self.step_count / self.max_steps * self.spec.training.epochs}
        return {"done": self.done, "step": self.step_count, "metrics": metrics}

    def finish(self, train_seconds: float = 0.0) -> dict[str, Any]:
        """The loss after training and the checkpoint (the layout of an own LoRA SFT job); an earlier
        run's result when this job id and spec had finished already."""
        if self.data.reused:
            return {**self.data.reused, "skipped_checkpoints": self.data.skipped}
        after = self.measure()
        spec = self.spec
        result = {"job_id": self.job_id, "steps": self.step_count, "epochs": spec.training.epochs,
                  "train_examples": len(self.data.train_chats), "eval_examples": len(self.data.eval_chats),
                  "before": self.before, "after": after, "train_seconds": train_seconds,
                  "assistant_only_loss": spec.training.assistant_only_loss, "init_from": None, "shared_base": True}
        extra = {SFT_SPEC_FILE: dump_sft_spec(spec).encode(), POLICY_FILE: json.dumps(policy_info(spec, None)).encode(),
                 **adapter_files(self.model)}
        ref = ckpt.save_checkpoint(
            spec.checkpoint.base_url, self.job_id, self.step_count,
            weights={n: p.detach().cpu() for n, p in self.model.named_parameters()},
            optimizer_state=to_cpu(self.optimizer.state_dict()),
            state={"policy_version": self.step_count, "kind": "sft", "result": result},
            extra_files=extra, tenant=self.tenant,
        )
        return {**result, "checkpoint": ref.url, "reused": False, "skipped_checkpoints": self.data.skipped}
