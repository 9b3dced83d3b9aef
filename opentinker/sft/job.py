"""SFT jobs: TRL's `SFTTrainer` on JSONL chat data, saved as an ordinary OpenTinker checkpoint.

The checkpoint has the RL layout (weights by the same parameter names, `policy.json`, `adapter/`
for LoRA), so `model.init_from`, `load_policy`, inference and the registry treat an SFT policy like
any other. Bad input fails before the model loads: the spec with `field.path: reason` lines, the
data file with the line number of each bad example (opentinker.sft.data).

Loss: on assistant tokens only (each assistant reply and its end-of-turn token), the tokens the
RL loop trains; TRL computes that mask from `{% generation %}` markers in the chat template. For
templates without markers we use TRL's training version when it knows one, else our marked copy
of the SmolLM2/ChatML template (opentinker.sft.template, checked to render the same text), else
the spec must say `training.assistant_only_loss: false`.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable
from typing import Any

import yaml

from opentinker.backend.device import placement
from opentinker.core.ids import job_id_for
from opentinker.core.seeding import seed_everything
from opentinker.core.spec import LoraSpec, SpecError
from opentinker.model import POLICY_FILE, adapter_files, load_model, policy_info, resolve_model, wrap_model
from opentinker.model.adapters import autocast_lora_inputs
from opentinker.sft.data import load_chats, split_chats
from opentinker.sft.spec import SFT_SPEC_FILE, SFTDataError, SFTSpec, dump_sft_spec
from opentinker.sft.template import training_chat_template
from opentinker.storage import checkpoint as ckpt
from opentinker.storage.preflight import check_job_storage
from opentinker.storage.resolve import resolve_checkpoint



def _reuse(spec: SFTSpec, job_id: str, tenant: str | None) -> ckpt.Intact:
    """The result of an earlier run of this job id with the same spec (a retried flow does not
    train twice), from its newest intact checkpoint; an earlier run with another spec is refused,
    since its checkpoint would mix in. Folders that are not intact are skipped, each named."""
    def earlier_result(url: str, owner: ckpt.Owner) -> dict[str, Any]:
        earlier = ckpt.read_file(url, SFT_SPEC_FILE, missing_ok=True, owner=owner)
        if (yaml.safe_load(earlier) if earlier else None) != spec.model_dump(mode="json"):
            raise SpecError(f"job_id: {job_id!r} already has a checkpoint from another spec ({url}); use a new job id")
        state = json.loads(ckpt.read_file(url, "state.json", owner=owner))
        return {**state["result"], "checkpoint": url, "reused": True}

    return ckpt.newest_intact(spec.checkpoint.base_url, job_id, ckpt.Owner(job_id, tenant), earlier_result)


def to_cpu(obj: Any) -> Any:
    """Optimizer state with every tensor on the CPU (a GPU job's checkpoint loads anywhere)."""
    import torch

    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_cpu(v) for v in obj)
    return obj


MetricsCallback = Callable[[int, dict[str, float]], Any]


class SFTJob:
    """Validates data, loads the model (from `model.init_from` when set), trains with SFTTrainer
    and writes the checkpoint. `model` stays available after `run` (for tests and notebooks)."""

    def __init__(self, spec: SFTSpec, job_id: str | None = None, tenant: str | None = None, model: Any = None):
        """`tenant`: whose job it is (its checkpoint is signed as such; None: the operator's). `model`: an
        adapter of a shared base to check and split the data for (opentinker.sft.shared), not loading one."""
        self.spec, self.tenant = spec, tenant
        self.job_id = job_id_for(spec, job_id)  # a bad id is refused before anything is read or written
        check_job_storage(spec)  # a wrong bucket or missing credentials: one line, before anything loads
        earlier = _reuse(spec, self.job_id, tenant)
        self.reused, self.skipped = earlier.loaded, earlier.skipped
        if self.reused:
            return
        chats = load_chats(spec.data.path)  # bad data fails before the model loads
        self.train_chats, self.eval_chats = split_chats(chats, spec.data.eval_fraction, spec.training.seed)

        from transformers import AutoTokenizer

        self.init_from = resolve_checkpoint(spec.model.init_from) if spec.model.init_from else None
        # the tokenizer alone first: template and lengths are checked before the model loads
        self.tokenizer = AutoTokenizer.from_pretrained(resolve_model(spec.model.name))
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        if spec.training.assistant_only_loss:
            self.tokenizer.chat_template = self._checked_template()
        self._check_lengths(chats)
        self.placement = placement(spec.resources.num_gpus, spec.model.dtype)
        if model is not None:
            self.model = model
            return

        import torch

        torch.set_num_threads(spec.resources.torch_threads or os.cpu_count() or 1)
        # the RL trainer's precision rule (backend/device.py): trained weights and AdamW float32, a LoRA's
        # frozen base in the compute precision, the passes under its autocast (TRL's bf16/fp16 switch)
        model, _ = load_model(spec.model.name, "float32", init_from=self.init_from)
        if isinstance(spec.adapter, LoraSpec):
            model = model.to(dtype=self.placement.weights_dtype(trained=False))
        seed_everything(spec.training.seed)  # the LoRA initialisation
        self.model = wrap_model(model, spec.adapter)
        autocast_lora_inputs(self.model, self.placement.compute_dtype)

    def _checked_template(self) -> str:
        """The marked template, refused unless it renders the data exactly as the original does."""
        marked = training_chat_template(self.tokenizer)
        for line, messages in (self.train_chats + self.eval_chats)[:100]:
            a = self.tokenizer.apply_chat_template(messages, tokenize=False)
            b = self.tokenizer.apply_chat_template(messages, tokenize=False, chat_template=marked)
            if a != b:
                raise SpecError(f"training.assistant_only_loss: the marked chat template renders line {line} differently; "
                                "set it to false")
        return marked

    def _check_lengths(self, chats: list) -> None:
        limit, errors = self.spec.training.max_length, []
        for line, messages in chats:
            n = len(self.tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"])
            if n > limit:
                errors.append(f"data.path: line {line}: {n} tokens, more than training.max_length={limit}")
        if errors:
            raise SFTDataError("\n".join(errors[:10]) + (f"\n… and {len(errors) - 10} more" if len(errors) > 10 else ""))

    def _trainer(self, out_dir: str, on_log: MetricsCallback | None, history: list):
        import torch
        from datasets import Dataset
        from transformers import PrinterCallback, TrainerCallback
        from trl import SFTConfig, SFTTrainer

        t = self.spec.training

        class Log(TrainerCallback):
            """Training-step metrics (TRL's loss, grad norm, token accuracy…) to the caller."""

            def on_log(self, args, state, control, logs=None, **kwargs):
                if logs and "loss" in logs:
                    point = {f"sft/{k}": float(v) for k, v in logs.items()
                             if k in ("loss", "grad_norm", "learning_rate", "mean_token_accuracy", "entropy", "num_tokens", "epoch")}
                    history.append({"step": state.global_step, **point})
                    if on_log:
                        on_log(state.global_step, point)

        config = SFTConfig(
            output_dir=out_dir, num_train_epochs=t.epochs, learning_rate=t.lr, lr_scheduler_type=t.lr_scheduler,
            per_device_train_batch_size=t.batch_size, per_device_eval_batch_size=t.batch_size,
            gradient_accumulation_steps=t.grad_accum, max_length=t.max_length, weight_decay=t.weight_decay,
            max_grad_norm=t.grad_clip, seed=t.seed, data_seed=t.seed, assistant_only_loss=t.assistant_only_loss,
            activation_checkpointing=t.gradient_checkpointing, logging_steps=t.logging_steps,
            dataloader_pin_memory=torch.cuda.is_available(),
            # autocast in the compute precision, our callback the tracking, and we write the only checkpoint
            # ourselves, in the OpenTinker format
            bf16=self.placement.compute_dtype == torch.bfloat16, fp16=self.placement.compute_dtype == torch.float16,
            use_cpu=self.placement.device.type == "cpu", report_to="none", save_strategy="no", eval_strategy="no",
            disable_tqdm=True, dataloader_num_workers=0, dataset_num_proc=None,
        )
        as_rows = lambda chats: Dataset.from_list([{"messages": m} for _, m in chats])
        trainer = SFTTrainer(model=self.model, args=config, train_dataset=as_rows(self.train_chats),
                             processing_class=self.tokenizer, callbacks=[Log()])
        trainer.remove_callback(PrinterCallback)  # metrics go to the caller, not to stdout
        return trainer, as_rows

    def _measure(self, trainer, rows) -> dict[str, float]:
        """Mean token loss (and top-1 accuracy) on the held-out and the training examples."""
        out: dict[str, float] = {}
        for name, chats in (("eval", self.eval_chats), ("train_set", self.train_chats)):
            if chats:
                m = trainer.evaluate(eval_dataset=rows(chats), metric_key_prefix=name)
                out[f"{name}/loss"] = float(m[f"{name}_loss"])
                out[f"{name}/mean_token_accuracy"] = float(m["eval_mean_token_accuracy"])
        return out

    def run(self, on_log: MetricsCallback | None = None) -> dict[str, Any]:
        """Train, measure before/after, checkpoint; `on_log(step, metrics)` sees every metric point."""
        if self.reused:
            return {**self.reused, "skipped_checkpoints": self.skipped}
        import tempfile

        t0 = time.perf_counter()
        history: list[dict[str, float]] = []
        with tempfile.TemporaryDirectory(prefix="opentinker-sft-") as out_dir:
            trainer, rows = self._trainer(out_dir, on_log, history)
            before = self._measure(trainer, rows)
            if on_log:
                on_log(0, before | {"sft/max_steps": float(self.max_steps)})
            train_start = time.perf_counter()
            trainer.train()
            train_seconds = time.perf_counter() - train_start
            steps = trainer.state.global_step
            after = self._measure(trainer, rows)
            if on_log:
                on_log(steps, after | {"sft/train_seconds": train_seconds})
            self.model.eval()
            result = {
                "job_id": self.job_id, "steps": steps, "epochs": self.spec.training.epochs,
                "train_examples": len(self.train_chats), "eval_examples": len(self.eval_chats),
                "before": before, "after": after, "history": history, "train_seconds": train_seconds,
                "assistant_only_loss": self.spec.training.assistant_only_loss, "init_from": self.init_from,
            }
            extra = {SFT_SPEC_FILE: dump_sft_spec(self.spec).encode(),
                     POLICY_FILE: json.dumps(policy_info(self.spec, self.init_from)).encode()}
            if isinstance(self.spec.adapter, LoraSpec):
                extra |= adapter_files(self.model)
            ref = ckpt.save_checkpoint(
                self.spec.checkpoint.base_url, self.job_id, steps,
                weights={n: p.detach().cpu() for n, p in self.model.named_parameters() if p.requires_grad},
                optimizer_state=to_cpu(trainer.optimizer.state_dict()),
                state={"policy_version": steps, "kind": "sft", "result": result},
                extra_files=extra, tenant=self.tenant,
            )
        return {**result, "checkpoint": ref.url, "seconds": time.perf_counter() - t0, "reused": False, "skipped_checkpoints": self.skipped}

    @property
    def max_steps(self) -> int:
        """Optimizer steps the run will take (as transformers counts them: a partial accumulation steps too)."""
        batches = math.ceil(len(self.train_chats) / self.spec.training.batch_size)
        return math.ceil(batches / self.spec.training.grad_accum) * self.spec.training.epochs


def run_sft(spec: SFTSpec, job_id: str | None = None, tracker_callback: MetricsCallback | None = None,
            tenant: str | None = None) -> dict[str, Any]:
    """One SFT job in this process; returns small, JSON-able facts (losses, steps, checkpoint URL)."""
    return SFTJob(spec, job_id, tenant=tenant).run(on_log=tracker_callback)
