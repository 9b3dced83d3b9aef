"""The client's side of the link: the user's game, hosted in the user's own process for a job
that runs elsewhere. The client opens a WebSocket to the gateway (nothing listens here, so it
works wherever the client can reach the gateway) and answers the job's calls (see
opentinker.env.linked): each call runs in a thread of its own, under the same hosting rules as
every other host, and its answer goes back as soon as it is ready.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from opentinker.env.hosting import generate_reply, generator_from_state, reset_reply, step_reply

log = logging.getLogger(__name__)
MAX_FRAME_BYTES = 16 * 1024**2


def websocket_url(gateway_url: str, job_id: str) -> str:
    base = gateway_url.rstrip("/")
    scheme = "wss" if base.startswith("https://") else "ws"
    return f"{scheme}://{base.split('://', 1)[1]}/v1/jobs/{job_id}/link"


class EnvironmentLink:
    """Serve `game_class` to job `job_id` until `close()` (or the process ends)."""

    def __init__(self, gateway_url: str, api_key: str | None, job_id: str, game_class: type, game_kwargs: dict[str, Any] | None = None,
                 threads: int = 64):
        self.game_class, self.game_kwargs, self.job_id = game_class, dict(game_kwargs or {}), job_id
        self.url = websocket_url(gateway_url, job_id)
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._sessions: dict[str, Any] = {}
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="env-link")
        self._outbox: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self._socket = None
        self.calls = self.frames = 0  # calls answered, frames of calls received

    def open(self) -> EnvironmentLink:
        """Connect (raises ConnectionError with the reason when the gateway refuses) and serve in the background."""
        from websockets.exceptions import InvalidStatus
        from websockets.sync.client import connect

        try:
            self._socket = connect(self.url, additional_headers=self._headers, max_size=MAX_FRAME_BYTES, open_timeout=30)
        except InvalidStatus as err:
            raise ConnectionError(f"the gateway refused the environment link of job {self.job_id}: HTTP {err.response.status_code}") from None
        except OSError as err:
            raise ConnectionError(f"cannot reach the gateway at {self.url}: {err}") from None
        threading.Thread(target=self._read, name="env-link-reader", daemon=True).start()
        threading.Thread(target=self._write, name="env-link-writer", daemon=True).start()
        return self

    @property
    def alive(self) -> bool:
        from websockets.protocol import State

        return self._socket is not None and self._socket.state is State.OPEN

    def close(self) -> None:
        if self._socket is not None:
            self._socket.close()
        self._outbox.put(None)
        for game in list(self._sessions.values()):
            _close_game(game)
        self._sessions.clear()

    # --- serving ---------------------------------------------------------------------------
    def _read(self) -> None:
        try:
            for frame in self._socket:
                try:
                    calls = json.loads(frame)["calls"]
                except (ValueError, KeyError, TypeError):
                    log.warning("dropped a malformed frame from the gateway")
                    continue
                self.frames += 1
                for call in calls:
                    self._pool.submit(self._answer, call)
        except Exception as err:  # noqa: BLE001 - the link closed: the job sees its calls fail
            log.info("environment link of job %s closed: %s", self.job_id, err)

    def _write(self) -> None:
        while (item := self._outbox.get()) is not None:
            batch = [item]
            while not self._outbox.empty() and len(batch) < 256:
                nxt = self._outbox.get_nowait()
                if nxt is None:
                    self._outbox.put(None)
                    break
                batch.append(nxt)
            try:
                self._socket.send(json.dumps({"results": batch}))
            except Exception:  # noqa: BLE001 - closed: the gateway fails what was owed
                return

    def _answer(self, call: dict[str, Any]) -> None:
        call_id = call.get("id")
        try:
            result = {"id": call_id, "ok": self._run(call)}
        except Exception as err:  # noqa: BLE001 - a game bug costs one episode, never the link
            result = {"id": call_id, "error": f"{type(err).__name__}: {err}"}
        self.calls += 1
        self._outbox.put(result)

    def _run(self, call: dict[str, Any]) -> Any:
        op = call.get("op")
        if op == "generate":
            return generate_reply(self.game_class, generator_from_state(call["rng_state"]), dict(call.get("config") or {}))
        if op == "reset":
            game = self.game_class(**{**self.game_kwargs, **dict(call.get("game_kwargs") or {})})
            self._sessions[call["session"]] = game
            return reset_reply(game, dict(call.get("task") or {}))
        if op == "step":
            return step_reply(self._sessions[call["session"]], str(call["action"]))
        if op == "close":
            _close_game(self._sessions.pop(call["session"], None))
            return {}
        raise ValueError(f"unknown call {op!r}")


def _close_game(game: Any) -> None:
    try:
        if game is not None:
            game.close()
    except Exception:  # noqa: BLE001 - closing is best effort
        pass
