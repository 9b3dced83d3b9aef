"""The SFT job spec: the sections every job shares (opentinker.core.spec.BaseJobSpec) plus the
chat data and the training settings. Imports no torch: the CLI and the gateway validate with it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import Field, field_validator, model_validator

from opentinker.core.spec import BaseJobSpec, LearningRate, Section, SpecError, dump_spec, read_spec_yaml, storage_url
from opentinker.core.spec_limits import SHARED_PASS_TOKENS, validate_spec  # an example longer than SHARED_PASS_TOKENS cannot share a base


SFT_SPEC_FILE = "sft_spec.yaml"
"""Written into an SFT checkpoint beside the RL files (an SFT run with the same job id and spec reuses it)."""


class SFTDataSpec(Section):
    path: str = Field(min_length=1, description="fsspec URL (or local path) of a JSONL file: one {\"messages\": [...]} chat per line")
    eval_fraction: float = Field(0.1, ge=0, lt=1, description="share of the examples held out to measure the loss before and after")

    @field_validator("path")
    @classmethod
    def _url(cls, v: str) -> str:
        return storage_url(v)


class SFTTrainingSpec(Section):
    epochs: int = Field(1, gt=0, description="passes over the training examples")
    lr: LearningRate = Field(1e-4, description="AdamW peak learning rate")
    batch_size: int = Field(8, gt=0, description="examples per forward/backward")
    grad_accum: int = Field(1, gt=0, description="micro-batches per optimizer step")
    max_length: int = Field(1024, gt=0, description="tokens per example; a longer example is refused (never truncated)")
    lr_scheduler: str = Field("linear", pattern=r"^(linear|constant|cosine)$", description="learning-rate schedule over the run: linear or cosine decay, or constant")
    weight_decay: float = Field(0.0, ge=0, description="AdamW decoupled weight decay")
    grad_clip: float = Field(1.0, gt=0, description="gradients are clipped to this global norm")
    assistant_only_loss: bool = Field(True, description="loss on assistant replies only (false: on whole conversations)")
    gradient_checkpointing: bool = Field(False, description="trade compute for memory (slower; for long examples on a GPU)")
    logging_steps: int = Field(1, gt=0, description="optimizer steps between metric points")
    seed: int = Field(0, description="seeds the example order, the held-out split and the adapter init")


class SFTSpec(BaseJobSpec):
    """One SFT job. Its checkpoint goes to <checkpoint.base_url>/<job_id>/step-<optimizer steps>/;
    the flow registers it as a version of registry.model_name (default '<tenant or project>-sft')."""

    data: SFTDataSpec = Field(description="the chat examples to train on")
    training: SFTTrainingSpec = Field(default_factory=SFTTrainingSpec, description="the optimizer and the passes over the data")

    @model_validator(mode="after")
    def _shares_a_plain_base(self) -> "SFTSpec":
        if self.resources.share_base and (self.adapter.kind != "lora" or self.model.init_from or self.training.gradient_checkpointing):
            raise ValueError("resources.share_base: only a LoRA job on a plain base (no model.init_from) without "
                             "training.gradient_checkpointing trains as an adapter of a shared base-model worker")
        if self.resources.share_base and self.training.max_length > SHARED_PASS_TOKENS:
            raise ValueError(f"training.max_length: {self.training.max_length} tokens; on a shared base (resources.share_base) "
                             f"a pass holds at most {SHARED_PASS_TOKENS} tokens, so an example may have at most that many")
        if self.resources.trainer_ranks > 1:
            raise ValueError("resources.trainer_ranks: SFT jobs train in one process (TRL's trainer); the sharded trainer is an RL job's")
        if self.model.dtype == "float16" and not self.resources.num_gpus:
            raise ValueError("model.dtype: float16 autocast trains on a GPU (TRL's fp16); on the CPU use bfloat16 or float32")
        return self


class SFTDataError(SpecError):
    """Data an SFT job cannot train on; one `data.path: line N: reason` per problem."""


def is_sft_spec(data: Any) -> bool:
    """An SFT spec by its shape: a `data` section and no environment (RL specs have `env`)."""
    return isinstance(data, dict) and "data" in data and "env" not in data


def parse_sft_spec(data: dict[str, Any]) -> SFTSpec:
    """Validate a plain dict into an SFTSpec, or raise SpecError (`field.path: reason` per line)."""
    return validate_spec(SFTSpec, data)


def load_sft_spec(path: str | Path) -> SFTSpec:
    return parse_sft_spec(read_spec_yaml(path))


def dump_sft_spec(spec: SFTSpec) -> str:
    return dump_spec(spec)
