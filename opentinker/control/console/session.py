"""Who is signed in to the console: a signed cookie, its CSRF token, and the operator's key.

The cookie (HttpOnly, SameSite=Strict, path /console) carries who signed in, when it expires, a
nonce, and a fingerprint of the key that signed in; it is signed with HMAC-SHA256 under a key
derived from the stack secret, so it cannot be forged and the API key itself never reaches the
browser's storage or a URL. Every request checks again that the tenant still exists with the same
key (removing a tenant or rotating its key ends its console sessions at once).

The operator is whoever holds the key in `<state_dir>/console-operator-key` (made on first use by
`operator_key(settings, create=True)`; `opentinker train` names the file, never the key). The
operator's console sees every tenant's jobs, each row naming its tenant.

The CSRF token is an HMAC of the session's nonce: a page carries it in a hidden field or a
<meta> tag, and every request that changes something must send it back (form field `csrf` or
header `X-CSRF-Token`).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import os
import secrets
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from opentinker.control.gateway.tenants import TenantStore

COOKIE = "opentinker_console"
LIFETIME_S = 12 * 3600
OPERATOR_FILE = "console-operator-key"
OPERATOR = "*operator*"  # the session's subject for the operator: no tenant name can look like it


@dataclass(frozen=True)
class Session:
    tenant: str | None  # None: the operator
    nonce: str
    expires: int

    @property
    def operator(self) -> bool:
        return self.tenant is None

    @property
    def who(self) -> str:
        return "operator" if self.tenant is None else self.tenant


def _fingerprint(key_sha256: str) -> str:
    return key_sha256[:16]


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def operator_key_path(settings: Any) -> Path:
    return Path(settings.state_dir) / OPERATOR_FILE


def operator_key(settings: Any, create: bool = False) -> str | None:
    """The operator's console key (None when there is none and `create` is false). Kept in the
    state folder beside the stack secret, owner-only."""
    path = operator_key_path(settings)
    if path.exists():
        return path.read_text().strip() or None
    if not create:
        return None
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write("otc-" + secrets.token_urlsafe(32))
    if path.exists():
        tmp.unlink()
    else:
        os.replace(tmp, path)
    return path.read_text().strip()


class Sessions:
    """Signs, reads and re-checks console sessions for one gateway."""

    def __init__(self, settings: Any, store: TenantStore):
        self.settings = settings
        self.store = store
        self._signing = hmac.new(settings.stack_secret().encode(), b"opentinker-console-session-v1", hashlib.sha256).digest()
        self._ended: dict[str, int] = {}  # nonce -> expiry of sessions signed out: a copied cookie dies with them

    # --- keys -------------------------------------------------------------------------------
    def _tenant_fingerprint(self, tenant: str) -> str | None:
        try:
            record = json.loads(self.store.path.read_text()).get(tenant)
        except (FileNotFoundError, ValueError):
            return None
        return _fingerprint(record["key_sha256"]) if isinstance(record, dict) and "key_sha256" in record else None

    def _operator_fingerprint(self) -> str | None:
        key = operator_key(self.settings)
        return _fingerprint(_sha(key)) if key else None

    def sign_in(self, key: str) -> tuple[Session, str] | None:
        """(session, cookie value) for a valid key (a tenant's or the operator's), else None."""
        key = (key or "").strip()
        if not key or len(key) > 512:
            return None
        op = operator_key(self.settings)
        if op and hmac.compare_digest(_sha(op), _sha(key)):
            subject, fingerprint = OPERATOR, _fingerprint(_sha(op))
        elif (tenant := self.store.authenticate(key)) is not None:
            subject, fingerprint = tenant, _fingerprint(_sha(key))
        else:
            return None
        session = Session(None if subject == OPERATOR else subject, secrets.token_urlsafe(16), int(time.time()) + LIFETIME_S)
        body = base64.urlsafe_b64encode(json.dumps({"s": subject, "n": session.nonce, "e": session.expires, "k": fingerprint},
                                                   separators=(",", ":")).encode()).decode().rstrip("=")
        return session, f"{body}.{self._mac(body)}"

    def _mac(self, body: str) -> str:
        return hmac.new(self._signing, body.encode(), hashlib.sha256).hexdigest()

    def read(self, cookie: str | None) -> Session | None:
        """The session a cookie carries, or None: unsigned, expired, or its key no longer valid."""
        if not cookie or len(cookie) > 1024 or "." not in cookie:
            return None
        body, _, mac = cookie.rpartition(".")
        if not hmac.compare_digest(self._mac(body), mac):
            return None
        try:
            data = json.loads(base64.urlsafe_b64decode(body + "=" * (-len(body) % 4)))
            subject, nonce, expires, fingerprint = str(data["s"]), str(data["n"]), int(data["e"]), str(data["k"])
        except (ValueError, KeyError, TypeError):
            return None
        if expires < time.time() or nonce in self._ended:
            return None
        now = self._operator_fingerprint() if subject == OPERATOR else self._tenant_fingerprint(subject)
        if now is None or not hmac.compare_digest(now, fingerprint):
            return None  # the tenant was removed, or its key (the operator's) changed
        return Session(None if subject == OPERATOR else subject, nonce, expires)

    def end(self, session: Session) -> None:
        """Sign the session out on the server too (this gateway's memory: a restart forgets it, and
        the session still ends at its expiry)."""
        now = time.time()
        self._ended = {n: e for n, e in self._ended.items() if e >= now}
        self._ended[session.nonce] = session.expires

    # --- CSRF -------------------------------------------------------------------------------
    def csrf(self, session: Session) -> str:
        return hmac.new(self._signing, f"csrf:{session.nonce}".encode(), hashlib.sha256).hexdigest()

    def csrf_ok(self, session: Session, token: str | None) -> bool:
        return bool(token) and hmac.compare_digest(self.csrf(session), str(token))
