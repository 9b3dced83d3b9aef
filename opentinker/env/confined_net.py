"""Connections to environment servers made only to addresses the operator allows, checked as
each connection is made.

The gateway and the worker check env.url before any request (opentinker.core.env_hosts), but a
tenant who controls a name's DNS could answer an allowed address then and another one (cloud
metadata, an internal service, the stack's own gateway or MLflow) when the client connects: DNS
rebinding. So the clients resolve and check once more at each connection, host and port, and
connect to that checked address; TLS still verifies the URL's own host name, and the Host header
stays the URL's.
"""

from __future__ import annotations

from typing import Any

import httpcore
import httpx

from opentinker.core.env_hosts import EnvHosts


class _CheckedBackend(httpcore.SyncBackend):
    """httpcore's sockets, opened only to the address the rule checked at this connection."""

    def __init__(self, hosts: EnvHosts):
        self.hosts = hosts

    def connect_tcp(self, host: str, port: int, timeout: float | None = None, local_address: str | None = None,
                    socket_options: Any = None) -> httpcore.NetworkStream:
        try:
            address = self.hosts.address_to_connect(host, port)
        except OSError as err:
            raise httpcore.ConnectError(str(err)) from None
        return super().connect_tcp(address, port, timeout=timeout, local_address=local_address, socket_options=socket_options)


def confined_client(hosts: EnvHosts, **kwargs: Any) -> httpx.Client:
    """An httpx.Client whose connections go only where `hosts` allows, without the environment's
    proxies. httpx (0.28) has no public hook for the network backend, so its transport's pool is
    replaced by httpcore's own with ours (tests/test_env_hosts.py rebinds a name to catch a change)."""
    limits = httpx.Limits()
    transport = httpx.HTTPTransport(trust_env=False, limits=limits)
    transport._pool = httpcore.ConnectionPool(network_backend=_CheckedBackend(hosts), max_connections=limits.max_connections,
                                              max_keepalive_connections=limits.max_keepalive_connections,
                                              keepalive_expiry=limits.keepalive_expiry)
    return httpx.Client(transport=transport, trust_env=False, **kwargs)


class _CheckedAsyncBackend:
    """An async network backend (httpcore's or httpcore2's AnyIOBackend inside) that opens TCP
    connections only to the address the rule checked at this connection; the check (DNS, the
    stack's listeners) runs in a worker thread, off the event loop."""

    def __init__(self, hosts: EnvHosts, inner: Any):
        self.hosts, self.inner = hosts, inner

    async def connect_tcp(self, host: str, port: int, timeout: float | None = None, local_address: str | None = None,
                          socket_options: Any = None) -> Any:
        import anyio

        try:
            address = await anyio.to_thread.run_sync(self.hosts.address_to_connect, host, port)
        except OSError as err:
            raise self.inner.connect_error(str(err)) from None
        return await self.inner.backend.connect_tcp(address, port, timeout=timeout, local_address=local_address,
                                                    socket_options=socket_options)

    async def connect_unix_socket(self, path: str, timeout: float | None = None, socket_options: Any = None) -> Any:
        raise self.inner.connect_error(f"{path}: environments are reached over TCP only")

    async def sleep(self, seconds: float) -> None:
        await self.inner.backend.sleep(seconds)


class _Core:
    """The httpcore flavour under an httpx flavour: its AnyIO backend and its ConnectError."""

    def __init__(self, core: Any):
        self.module, self.backend, self.connect_error = core, core.AnyIOBackend(), core.ConnectError


def confined_async_transport(hosts: EnvHosts, *, flavour: str = "httpx") -> Any:
    """An httpx.AsyncHTTPTransport (`flavour="httpx2"`: httpx2's, what the official MCP SDK's client
    takes) whose connections go only where `hosts` allows, checked at each TCP connection as
    `confined_client`'s are, without the environment's proxies; same pool replacement as there."""
    import importlib

    http = importlib.import_module(flavour)
    core = _Core(importlib.import_module({"httpx": "httpcore", "httpx2": "httpcore2"}[flavour]))
    limits = http.Limits()
    transport = http.AsyncHTTPTransport(trust_env=False, limits=limits)
    transport._pool = core.module.AsyncConnectionPool(
        ssl_context=getattr(transport._pool, "_ssl_context", None), network_backend=_CheckedAsyncBackend(hosts, core),
        max_connections=limits.max_connections, max_keepalive_connections=limits.max_keepalive_connections,
        keepalive_expiry=limits.keepalive_expiry)
    return transport


def confined_async_client(hosts: EnvHosts, *, flavour: str = "httpx", **kwargs: Any) -> Any:
    """An httpx.AsyncClient (or httpx2's) on `confined_async_transport`."""
    import importlib

    return importlib.import_module(flavour).AsyncClient(transport=confined_async_transport(hosts, flavour=flavour),
                                                       trust_env=False, **kwargs)
