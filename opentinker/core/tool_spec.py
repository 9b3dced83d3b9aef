"""`env.tools`: the tools a job gives every episode, beside its game's own (`get_tools`).

    env:
      tools:
        - mcp: https://tools.example.com/mcp      # every tool of an MCP server (streamable HTTP)
          timeout_s: 20
        - python: {wall_s: 5, memory_mb: 256}     # model-written code in the bubblewrap sandbox

An MCP URL obeys the rule env.url does (OPENTINKER_ENV_URL_ALLOW; the stack's own servers,
metadata and private addresses refused): the gateway checks it before submission, the worker
before it lists the tools and again at each connection.
"""

from __future__ import annotations

from typing import Annotated, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator


class _Entry(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, str_max_length=2048)


class McpTools(_Entry):
    mcp: str = Field(description="an MCP server's streamable-HTTP URL: all of its tools are the job's")
    timeout_s: float = Field(30.0, gt=0, le=600, description="seconds for one call (listing the tools too)")

    @field_validator("mcp")
    @classmethod
    def _http(cls, v: str) -> str:
        if not v.startswith(("http://", "https://")):
            raise ValueError(f"{v!r} must start with http:// or https://")
        return v


class SandboxLimitsSpec(_Entry):
    wall_s: float = Field(5.0, gt=0, le=120, description="wall-clock seconds a run may take; its process group is killed then")
    cpu_s: int = Field(5, ge=1, le=120, description="CPU seconds")
    memory_mb: int = Field(512, ge=32, le=16384, description="address space of each process, MiB")
    processes: int = Field(32, ge=1, le=1024, description="processes and threads at once")
    file_size_mb: int = Field(16, ge=0, le=1024, description="largest file it may write, MiB")
    output_bytes: int = Field(65536, ge=256, le=16 * 1024 * 1024, description="stdout and stderr kept, each")


class PythonTool(_Entry):
    python: SandboxLimitsSpec = Field(default_factory=SandboxLimitsSpec, description="the `python` tool: code run in the sandbox")


ToolSource = Annotated[Union[McpTools, PythonTool], Field(union_mode="left_to_right")]
