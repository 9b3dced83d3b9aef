"""What an inference job serves and on what: the parameter of the `serve-model` flow."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class InferenceSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model_path: str = Field(min_length=1, description="a checkpoint: step folder, job folder (its latest complete step) "
                            "or registry URI models:/<name>@<alias> | models:/<name>/<version>")
    num_gpus: float = Field(0, ge=0, description="0: this CPU; N > 0: vLLM on N GPUs")
    engine: Literal["auto", "hf", "vllm"] = Field("auto", description="auto: vllm with GPUs, and on a CPU where vLLM runs "
                                                  "the model (else hf, the transformers engine); see inference.launch.serving_engine")
    max_model_len: int | None = Field(None, gt=0, description="context length to serve (default: the model's own)")
    ttl_s: float | None = Field(None, gt=0, description="stop serving after this many seconds (default: until cancelled)")


def endpoint_key(job_id: str) -> str:
    """Key of the Prefect artifact where a serving job publishes its endpoint (Prefect keys:
    lowercase letters, digits and dashes); the flow writes it, the gateway reads it."""
    return re.sub(r"[^a-z0-9-]", "-", f"endpoint-{job_id}".lower())
