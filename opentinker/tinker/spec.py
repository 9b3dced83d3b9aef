"""A Tinker session's job spec: what its flow run takes (and the Prefect UI shows as its form)."""

from __future__ import annotations

from pydantic import BaseModel, Field


class TinkerSessionSpec(BaseModel):
    session_id: str = Field(description="the session's id, `<tenant>-tk-<hex>` (its job id)")
    num_gpus: float = Field(0.0, ge=0, description="GPUs the session's actor holds (0: CPU)")
    user_metadata: dict[str, str] = Field(default_factory=dict, description="what the client sent with create_session")
    sdk_version: str = Field("", description="the client's tinker SDK version")
