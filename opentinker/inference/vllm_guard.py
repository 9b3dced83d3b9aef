"""Runs inside vLLM's API server (`--middleware`, in vLLM's environment): the guards every server of
the project wears (opentinker.core.asgi, which imports nothing but the standard library), around
every route vLLM has or adds later.

- The owner's key, by default-deny: every request but the bare health check carries
  `Authorization: Bearer <key>` or gets 401. vLLM's own `--api-key` guards only its `/v1`-like
  prefixes, so `/collective_rpc` (a weight reload), `/pause`, `/sleep`, `/invocations`, `/tokenize`
  and `/metrics` answered anyone who reached the port. The key comes from OPENTINKER_SERVER_KEY
  (the process's environment, readable by its owner only), never the command line (`ps` shows
  that to every local user); no key: no guard (a server its operator opened on purpose).
- A request body over the stack's limit is refused with 413 while it streams in, before vLLM
  buffers it (OPENTINKER_MAX_REQUEST_BYTES).
- A request body that is not JSON we read (nested too deep, invalid UTF-8, ...) or a chat history
  no template should be handed (an unknown role, an assistant's call whose arguments are not a
  JSON object, or nest 5,000 deep: vLLM answered that one 500, RecursionError) is a 400 with one
  line naming the message, before vLLM reads it (chat_rules.py, the checks our server makes).
- A route that raises (a refused `/collective_rpc` call does) answers 500 with one line and keeps
  its connection: vLLM's Starlette closed it, and the client's next request on it failed in transport.

vLLM builds a middleware from its class alone, so both come from the environment (VLLMServer sets them).
"""

from __future__ import annotations

import logging
import os

from opentinker.core.asgi import BearerToken, BodyLimit, ServerErrors
from opentinker.inference.chat_rules import CheckedBodies

KEY_VARIABLE = "OPENTINKER_SERVER_KEY"


class Guard:
    def __init__(self, app):
        inner = BodyLimit(ServerErrors(CheckedBodies(app), logging.getLogger("opentinker.vllm_guard")),
                          int(os.environ["OPENTINKER_MAX_REQUEST_BYTES"]))
        key = os.environ.get(KEY_VARIABLE)  # read at every construction: a second API server process guards too
        self.app = BearerToken(inner, lambda: (key,), open_paths=("/health",)) if key else inner

    async def __call__(self, scope, receive, send):
        await self.app(scope, receive, send)
