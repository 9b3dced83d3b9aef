"""HTTP to the servers the runtime starts for itself (a job's vLLM or HF inference server, the
Tinker vLLM engine's): keep-alive that cannot race, and a transport fault that costs a retry, not a job.

uvicorn closes an idle connection after its keep-alive (5 s by default, vLLM's too) and httpx keeps
one for 5 s: a request sent on a connection the server closes at that instant fails in transport
(`ReadError`, `RemoteProtocolError`) though the server is alive. A job's step leaves its server idle
for its update and sync, 4.5-5.5 s on a 2-core CPU, and `make demo` died of it twice in two runs. So
the servers started here keep an idle connection `SERVER_KEEP_ALIVE_S`, their clients drop one after
`CLIENT_KEEP_ALIVE_S` (well before the server can), and a transport error on a server that is still
alive is retried on a fresh connection where the request can be repeated. `ServerGone` only when
the server is gone, saying how it ended.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import httpx  # imported where used: the core runtime (a job without a server) runs without it

log = logging.getLogger(__name__)

SERVER_KEEP_ALIVE_S = 75  # uvicorn's timeout_keep_alive, vLLM's VLLM_HTTP_TIMEOUT_KEEP_ALIVE, for every server started here
CLIENT_KEEP_ALIVE_S = 20.0  # httpx's keepalive_expiry for clients of those servers: always shorter than the server's
RETRIES = 3


class ServerGone(RuntimeError):
    """The inference server a job samples through is gone (its process ended, or its engine died)."""


class RequestLost(RuntimeError):
    """A request that cannot be repeated failed in transport on a server that is still alive."""


def keep_alive_env() -> dict[str, str]:
    """The variable vLLM's server reads for its keep-alive (uvicorn's timeout_keep_alive)."""
    return {"VLLM_HTTP_TIMEOUT_KEEP_ALIVE": str(SERVER_KEEP_ALIVE_S)}


def own_client(base_url: str, api_key: str | None = None, timeout_s: float = 600.0, max_connections: int = 100,
               uds: str | None = None) -> httpx.Client:
    """An httpx client for a server started here (over the Unix socket `uds`, where it listens on
    one): its key as a bearer token, no proxies, and idle connections dropped before the server
    would close them."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections, keepalive_expiry=CLIENT_KEEP_ALIVE_S)
    return httpx.Client(base_url=base_url.rstrip("/"), headers=headers, timeout=timeout_s, trust_env=False,
                        transport=httpx.HTTPTransport(uds=uds, limits=limits))


def fresh_client(client: httpx.Client, uds: str | None = None) -> httpx.Client:
    """A client like `client` whose every request opens a connection of its own (none is kept)."""
    import httpx

    return httpx.Client(base_url=client.base_url, headers=client.headers, timeout=client.timeout, trust_env=False,
                        transport=httpx.HTTPTransport(uds=uds, limits=httpx.Limits(max_keepalive_connections=0)))


def health_gone(fresh: httpx.Client) -> str | None:
    """How a server that failed in transport is doing, asked on a fresh connection to its bare
    `/health`: None while it answers 200, else what it answered (vLLM says 503 once its engine died)."""
    import httpx

    try:
        reply = fresh.get("/health", timeout=5.0)
    except httpx.HTTPError as err:
        return f"it does not answer its health check ({type(err).__name__})"
    if reply.status_code == 200:
        return None
    return f"its health check answers {reply.status_code}" + (" (its engine died)" if reply.status_code == 503 else "")


class OwnServer:
    """Requests to one server: `call` retries a repeatable request that failed in transport while
    the server lives, on a fresh connection, and says ServerGone once it does not. `ended()`: how
    the server's process ended (None while it runs; an external server has no process to ask);
    `cause()`: the last error its log names, for a process that lives with a dead engine."""

    def __init__(self, client: httpx.Client, what: str, ended: Callable[[], str | None] = lambda: None,
                 cause: Callable[[], str] = lambda: "", resume_hint: str = "run the job id again to resume from its last checkpoint",
                 uds: str | None = None):
        self.client, self.what, self.ended, self.cause, self.resume_hint, self.uds = client, what, ended, cause, resume_hint, uds
        self.retried = 0  # transport faults retried on a live server, for the job's metrics
        self._fresh: httpx.Client | None = None
        self._lock = threading.Lock()

    @property
    def fresh(self) -> httpx.Client:
        with self._lock:
            if self._fresh is None:
                self._fresh = fresh_client(self.client, self.uds)
            return self._fresh

    def gone(self) -> str | None:
        """None while the server is alive and healthy, else how it ended or what ails it."""
        if (ended := self.ended()) is not None:
            return ended
        if (ails := health_gone(self.fresh)) is None:
            return None
        cause = self.cause()
        return f"{ails}: {cause}" if cause else ails

    def gone_error(self, how: str) -> ServerGone:
        return ServerGone(f"{self.what} is gone: {how}; {self.resume_hint}")

    def raise_if_dead(self, reply: httpx.Response) -> None:
        """A server error from a server whose engine died (vLLM answers 500 with "EngineCore
        encountered an issue" and its health check 503) is ServerGone, saying so."""
        if reply.status_code >= 500 and (how := self.gone()) is not None:
            raise self.gone_error(how)

    def call(self, method: str, path: str, *, repeatable: bool, **kwargs: Any) -> httpx.Response:
        """The server's reply. A transport fault: ServerGone when the server is gone; a retry on a
        fresh connection (up to RETRIES, logged) when it lives and the request is `repeatable`;
        RequestLost when it lives and the request is not."""
        import httpx

        faults = (httpx.NetworkError, httpx.RemoteProtocolError)  # the connection failed; a timeout is not retried (a slow server)
        for attempt in range(RETRIES + 1):
            try:
                return (self.client if attempt == 0 else self.fresh).request(method, path, **kwargs)  # a retry: never a pooled connection
            except httpx.TimeoutException as err:
                if (how := self.gone()) is not None:
                    raise self.gone_error(how) from None
                raise RequestLost(f"{method} {path} to {self.what} got no answer in time ({type(err).__name__}) though the "
                                  "server is alive: paused, sleeping or overloaded") from err
            except faults as err:
                if (how := self.gone()) is not None:
                    raise self.gone_error(how) from None
                if not repeatable:
                    raise RequestLost(f"{method} {path} to {self.what} failed in transport ({type(err).__name__}) though the "
                                      "server is alive, and cannot be repeated safely") from err
                if attempt == RETRIES:
                    raise RequestLost(f"{method} {path} to {self.what} failed in transport {RETRIES + 1} times "
                                      f"({type(err).__name__}) though the server is alive") from err
                self.retried += 1
                log.warning("%s %s to %s failed in transport (%s: %s); the server is alive: retried on a fresh connection",
                            method, path, self.what, type(err).__name__, err or "no detail")
                time.sleep(0.1 * attempt)  # the first retry at once: a fresh connection is the cure
        raise AssertionError("unreachable")

    def close(self) -> None:
        self.client.close()
        if self._fresh is not None:
            self._fresh.close()
