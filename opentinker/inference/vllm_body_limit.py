"""Runs inside vLLM's API server (`--middleware`, in vLLM's environment): the 413 that every server
of the project answers to a request body over the stack's limit (opentinker.core.asgi.BodyLimit,
which imports nothing but the standard library), refused while it streams in, before vLLM buffers
it. vLLM builds a middleware from its class alone, so the limit comes from the environment
(OPENTINKER_MAX_REQUEST_BYTES, which VLLMServer sets from the settings)."""

from __future__ import annotations

import os

from opentinker.core.asgi import BodyLimit as _BodyLimit


class BodyLimit(_BodyLimit):
    def __init__(self, app):
        super().__init__(app, int(os.environ["OPENTINKER_MAX_REQUEST_BYTES"]))
