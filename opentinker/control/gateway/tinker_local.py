"""A gateway whose Tinker sessions run in this process: for tests of the protocol and for the benchmarks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from opentinker.inference.server import serve_in_thread
from opentinker.tinker.local import LocalSessions


def local_gateway(root: Path, tenants: tuple[str, ...] = ("alice",), placement: Any = None, storage_url: str | None = None,
                  shared_bases: bool = False, max_call_tokens: int | None = None, **gateway_settings: Any):
    """(gateway URL, {tenant: API key}, LocalSessions, server): a gateway on 127.0.0.1 whose Tinker
    sessions run in this process, state and storage under `root` (storage under `storage_url`
    instead when given: s3://...); `shared_bases`: all sessions' training clients share each base;
    `max_call_tokens`: the sessions' bound on a call; `gateway_settings`: the gateway's own (max_request_bytes, tinker_max_sessions, tinker_absent_after_s, …).
    Stop with `server.stop()` and `sessions.close()`."""
    from opentinker.control.gateway.app import create_app as gateway_app
    from opentinker.control.gateway.tenants import TenantStore
    from opentinker.core.settings import Settings
    from opentinker.inference.launch import free_port

    port = free_port("127.0.0.1")
    settings = Settings(**{"state_dir": root / "state", "host": "127.0.0.1", "gateway_port": port, **gateway_settings})  # its own URL is right in signed links
    store = TenantStore(settings.state_dir / "tenants.json")
    keys = {name: store.create(name) for name in tenants}
    sessions = LocalSessions(storage_url or root / "storage", settings.models_folder, max_sessions=settings.tinker_max_sessions,
                             placement=placement, shared_bases=shared_bases, max_call_tokens=max_call_tokens,
                             absent_s=settings.tinker_absent_after_s)
    server = serve_in_thread(gateway_app(settings, tinker_sessions=sessions), "127.0.0.1", port)
    return server.url, keys, sessions, server
