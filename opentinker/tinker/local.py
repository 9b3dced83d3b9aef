"""Tinker sessions in this process (no Prefect, no Ray): what the gateway's Tinker routes relay to
when it is made with `create_app(settings, tinker_sessions=LocalSessions(...))`. For tests of the
protocol and for the benchmarks, through the unmodified SDK and the same two HTTP hops (gateway,
session server) as the stack; the stack's own path (flow run, Ray actor) has its own tests."""

from __future__ import annotations

import secrets
from pathlib import Path
from typing import Any

from opentinker.inference.server import serve_in_thread
from opentinker.storage.committed import join_url
from opentinker.tinker.paths import SessionGone, SessionLimit, absent_line
from opentinker.tinker.server import create_app
from opentinker.tinker.session import TinkerSession
from opentinker.tinker.shared_bases import SharedBases


class LocalSessions:
    def __init__(self, storage_root: Path | str, models_folder: Path, max_sessions: int = 4, placement: Any = None,
                 shared_bases: bool = False, registry_url: str | None = None, max_call_tokens: int | None = None,
                 absent_s: float | None = None):
        """`storage_root`: a folder, or a URL (s3://bucket/prefix) under which tenants' checkpoints live.
        `shared_bases`: every session's training clients of a base share one copy of it (tinker.shared_bases).
        `registry_url`: an MLflow server whose registered versions a checkpoint delete must spare (None: these
        sessions register nothing, so deletes ask no registry). `max_call_tokens`: the most tokens of one
        forward(_backward) call (None: the settings'). `absent_s`: the settings' tinker_absent_after_s unless given."""
        from opentinker.core.settings import get_settings

        self.storage_root, self.models_folder, self.max_sessions = storage_root, models_folder, max_sessions
        self.max_call_tokens = max_call_tokens or get_settings().tinker_max_call_tokens
        self.absent_s = absent_s or get_settings().tinker_absent_after_s
        self.registry_url = registry_url
        self.placement = placement
        self.bases = SharedBases(models_folder, placement) if shared_bases else None
        self.live: dict[str, tuple[TinkerSession, Any, str]] = {}
        self.ended: dict[str, str] = {}

    def storage_url(self, tenant: str) -> str:
        root = str(self.storage_root)
        return join_url(root if "://" in root else f"file://{root}", "tenants", tenant)

    def create(self, tenant: str, body: dict[str, Any]) -> str:
        """A new session; at the tenant's limit, sessions whose clients sent nothing for
        `absent_s` end first (Expired, as the stack's gateway does)."""
        mine = [s for s in self.live if s.startswith(f"{tenant}-")]
        if len(mine) >= self.max_sessions:
            for session_id in mine:
                idle_s = self.live[session_id][0].idle_seconds()
                if idle_s > self.absent_s:
                    self.end(session_id, absent_line(idle_s, self.absent_s))
            mine = [s for s in self.live if s.startswith(f"{tenant}-")]
        if len(mine) >= self.max_sessions:
            raise SessionLimit(tenant, len(mine), self.max_sessions, self.absent_s)
        session_id = f"{tenant}-tk-{secrets.token_hex(6)}"
        session = TinkerSession(session_id, tenant, self.storage_url(tenant), self.models_folder, self.placement, trainers=self.bases,
                                engines=self.bases.sampler_engines if self.bases else None, max_call_tokens=self.max_call_tokens)
        token = secrets.token_hex(16)
        server = serve_in_thread(create_app(session, token), "127.0.0.1", 0)
        self.live[session_id] = (session, server, token)
        return session_id

    def endpoint(self, tenant: str, session_id: str) -> tuple[str, str]:
        if session_id in self.ended:
            raise SessionGone(f"session {session_id} has ended ({self.ended[session_id]})")
        if session_id not in self.live or not session_id.startswith(f"{tenant}-"):
            raise LookupError(session_id)
        session, server, token = self.live[session_id]
        if session.finished:
            self.end(session_id, f"finished by its client ({session.finished})")
            raise SessionGone(f"session {session_id} has ended ({self.ended[session_id]})")
        return server.url, token

    def unanswered(self, tenant: str, session_id: str, url: str) -> None:
        """Its server (a thread of this process) did not answer: SessionGone if the session ended."""
        self.endpoint(tenant, session_id)

    def end(self, session_id: str, why: str) -> None:
        session, server, _ = self.live.pop(session_id)
        server.stop()
        session.close()
        self.ended[session_id] = why

    def list(self, tenant: str) -> list[str]:
        return [s for s in [*self.live, *self.ended] if s.startswith(f"{tenant}-")]

    def forget(self, session_id: str) -> None:
        pass

    def finish(self, tenant: str, session_id: str, body: dict[str, Any]) -> None:
        if session_id in self.live and session_id.startswith(f"{tenant}-"):
            self.end(session_id, f"finished by its client ({(body.get('reason') or {}).get('type', 'success')})")

    def close(self) -> None:
        for session_id in list(self.live):
            self.end(session_id, "test over")
        if self.bases is not None:
            self.bases.close()

