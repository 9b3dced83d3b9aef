"""A real uvicorn server for an ASGI app in a thread of the test process (env servers, OpenEnv apps)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import uvicorn


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServedApp:
    """`make_app()` behind uvicorn on 127.0.0.1 (or another loopback `host`, on a given `port`);
    `stop()` then `start()` restarts it on the same port."""

    def __init__(self, make_app: Callable[[], Any], host: str = "127.0.0.1", port: int | None = None):
        self.make_app, self.host = make_app, host
        self.port = port or free_port()
        self.url = f"http://{host}:{self.port}"
        self.start()

    def start(self) -> None:
        config = uvicorn.Config(self.make_app(), host=self.host, port=self.port, log_level="warning", access_log=False,
                                ws_max_size=1024**2)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "server did not start"
            time.sleep(0.01)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        assert not self.thread.is_alive()
