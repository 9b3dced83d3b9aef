"""Tenants and their API keys. Only a key's SHA-256 is stored; the key itself is shown once.

Keys are 32 random bytes, so a plain hash (no salt, no slow KDF) cannot be brute-forced; the
lookup compares digests in constant time.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import re
import secrets
from datetime import datetime, timezone
from pathlib import Path

from opentinker.core.ids import shown

# No '-' in a tenant name: job ids and model names are `<tenant>-<name>`, so `acme` must never be
# a prefix that also reads as another tenant (`acme-corp`). Matched whole (fullmatch): `^…$` with
# match() would let `zed\n` through, a tenant whose every job id and tag is broken.
TENANT_NAME = re.compile(r"[a-z][a-z0-9]{1,31}")
# Names that already mean something to the service: the operator's project, its experiments, ...
RESERVED = frozenset({"default", "admin", "root", "operator", "system", "opentinker", "internal", "registry",
                      "evaluation", "inference", "tenants", "public", "api", "prefect", "mlflow", "ray"})
# `tml-`: the tinker SDK refuses a key without it, so one key serves both doors (keys made before, `otk_…`, still work natively).
KEY_PREFIX = "tml-"


class UnknownTenant(LookupError):
    """No tenant of that name in the store."""


def _digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


class TenantStore:
    """A JSON file of {tenant: {key_sha256, created}}, written atomically (owner-only)."""

    def __init__(self, path: Path):
        self.path = path

    def _read(self) -> dict[str, dict[str, str]]:
        try:
            return json.loads(self.path.read_text())
        except FileNotFoundError:
            return {}

    def _write(self, data: dict[str, dict[str, str]]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1)
        os.replace(tmp, self.path)

    def names(self) -> list[str]:
        return sorted(self._read())

    def create(self, name: str, rotate: bool = False) -> str:
        """Add a tenant (or give an existing one a new key with rotate=True); returns the key."""
        if not isinstance(name, str) or not TENANT_NAME.fullmatch(name):
            raise ValueError(f"tenant name {shown(name)}: must be 2-32 lowercase letters and digits, starting with a letter")
        if name in RESERVED:
            raise ValueError(f"tenant name {name!r} is reserved")
        data = self._read()
        if name in data and not rotate:
            raise ValueError(f"tenant {name!r} exists (rotate its key with --rotate)")
        key = KEY_PREFIX + secrets.token_urlsafe(32)
        data[name] = {"key_sha256": _digest(key), "created": datetime.now(timezone.utc).isoformat()}
        self._write(data)
        return key

    def remove(self, name: str) -> None:
        """Forget a tenant (any stored name, even one an older version let in): its key stops
        authenticating at the next request, on both doors. Its jobs and data are left alone."""
        data = self._read()
        if name not in data:
            raise UnknownTenant(f"tenant {shown(name)}: no such tenant (`opentinker tenant list` names them)")
        del data[name]
        self._write(data)

    def authenticate(self, key: str | None) -> str | None:
        """The tenant owning `key`, or None (also for a stored name that breaks the naming rule:
        one an older version let in with a trailing newline is no tenant; `tenant remove` deletes it)."""
        if not key:
            return None
        digest = _digest(key)
        found = None
        for name, record in self._read().items():
            if hmac.compare_digest(record["key_sha256"], digest):
                found = name
        return found if found is not None and TENANT_NAME.fullmatch(found) else None
