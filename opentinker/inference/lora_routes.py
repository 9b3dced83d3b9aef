"""vLLM's runtime LoRA endpoints on our server, so one rollout engine syncs with either server.

    POST /v1/load_lora_adapter    {"lora_name", "lora_path"} -> 200 "Success: ..."; 400 when the
                                  name is taken or the folder is not an adapter for this base
    POST /v1/unload_lora_adapter  {"lora_name"} -> 200; 404 when no such adapter is loaded

A loaded adapter is served under its name: it is listed by /v1/models (parent: the base) and a
request whose `model` is that name samples from the base with that adapter. The server takes
adapters only when it was made for them (`HFEngine.for_adapters`); the folder is read from this
machine's disk, safetensors only.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, Field

from opentinker.inference.engine_hf import HFEngine

log = logging.getLogger(__name__)


class LoadLoraAdapter(BaseModel):
    lora_name: str = Field(min_length=1, max_length=200)
    lora_path: str = Field(min_length=1, max_length=4096)


class UnloadLoraAdapter(BaseModel):
    lora_name: str = Field(min_length=1, max_length=200)


def add_lora_routes(app: FastAPI, engine: HFEngine, error: Any) -> None:
    """Add the two endpoints to `app`; `error` is the server's OpenAI-shaped exception type."""

    @app.post("/v1/load_lora_adapter")
    def load(req: LoadLoraAdapter) -> PlainTextResponse:  # a plain def: loading blocks, FastAPI runs it in a thread
        try:
            engine.load_adapter(req.lora_name, req.lora_path)
        except ValueError as err:
            raise error(400, str(err), param="lora_path") from None
        except Exception as err:  # noqa: BLE001 - peft's error for an adapter that does not fit the base
            log.exception("loading adapter %s from %s", req.lora_name, req.lora_path)
            raise error(400, f"cannot load {req.lora_path} as {req.lora_name!r}: {type(err).__name__}: {err}", param="lora_path") from None
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    def unload(req: UnloadLoraAdapter) -> PlainTextResponse:
        try:
            engine.unload_adapter(req.lora_name)
        except KeyError:
            raise error(404, f"The lora adapter '{req.lora_name}' cannot be found.", param="lora_name", kind="NotFoundError") from None
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' removed successfully.")
