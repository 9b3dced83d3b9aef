"""Ids and `tinker://` paths, and where their checkpoints live in a tenant's storage.

    session    <tenant>-tk-<hex>                     (a job id: the session's Prefect flow run)
    model      <session>:train:<n>                   (a training run; `training_run_id` on the REST side)
    sampler    <session>:sample:<n>
    request    <session>:req:<n>
    path       tinker://<model>/weights/<name>          training state (weights, optimizer, step)
               tinker://<model>/sampler_weights/<name>  weights for sampling (a peft adapter folder)
               tinker://<model>/external_weights/<name> the peft adapter alone, to download

A checkpoint is the committed folder `<tenant storage>/tinker/<model>/<kind>/<name>/`, and each
training run has `<tenant storage>/tinker/<model>/run.json`. A path is always resolved inside the
storage of the tenant who names it, so another tenant's path reads exactly like a missing one.
Every id and name is checked against a strict pattern first: nothing a tenant sends becomes a
path segment unchecked. No torch here (the gateway lists and deletes checkpoints too).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from opentinker.storage.committed import committed_manifest, join_url, makedirs, remove_committed, update_manifest, url_to_fs

SESSION = re.compile(r"^[a-z][a-z0-9]{1,31}-tk-[0-9a-f]{12}$")
MODEL = re.compile(r"^(?P<session>[a-z][a-z0-9]{1,31}-tk-[0-9a-f]{12}):train:(?P<n>\d{1,6})$")
SAMPLER = re.compile(r"^(?P<session>[a-z][a-z0-9]{1,31}-tk-[0-9a-f]{12}):sample:(?P<n>\d{1,9})$")
REQUEST = re.compile(r"^(?P<session>[a-z][a-z0-9]{1,31}-tk-[0-9a-f]{12}):req:(?P<n>\d{1,12})$")
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
KINDS = {"weights": "training", "sampler_weights": "sampler", "external_weights": "external"}
RUN_FILE = "run.json"
TTL_RANGE_S = (3600, 10 * 365 * 86400)  # what the SDK documents for set_checkpoint_ttl: an hour to ten years


class PathError(ValueError):
    """A malformed id, name or `tinker://` path (what the client sees)."""


class NotFound(LookupError):
    """No such thing for this tenant (another tenant's reads the same)."""


class SessionGone(LookupError):
    """The session ended (finished, expired, cancelled or failed); the message says how."""


class SessionStarting(RuntimeError):
    """The session's job has not started serving yet."""


# What a client whose session ended without its close() does next: its saved states outlive the session.
RESUME = ("start a new session and resume from your last save_state with create_training_client_from_state_with_optimizer "
          "(create_training_client_from_state for the weights alone)")


class SessionLimit(ValueError):
    """A tenant at its limit of live sessions (HTTP 429, not to be retried: only an end frees a place)."""

    def __init__(self, tenant: str, live: int, limit: int, absent_s: float | None = None):
        gone = f"; a session whose client is gone gives its place {absent_s:g} s after its last heartbeat" if absent_s else ""
        super().__init__(f"tenant {tenant} has {live} live Tinker sessions, the limit is {limit} (OPENTINKER_TINKER_MAX_SESSIONS): "
                         f"close one (ServiceClient.close() or a `with` block){gone}")


def absent_line(idle_s: float, absent_s: float) -> str:
    """Why a session whose client went quiet was ended to seat its tenant's new one."""
    return (f"expired: no call or heartbeat for {idle_s:.0f} s, and a new session of its tenant needed its place "
            f"(OPENTINKER_TINKER_ABSENT_AFTER_S: {absent_s:g} s)")


def session_of(identifier: str) -> str | None:
    """The session an id belongs to (model, sampler, request or the session itself), or None."""
    if SESSION.match(identifier):
        return identifier
    for pattern in (MODEL, SAMPLER, REQUEST):
        m = pattern.match(identifier)
        if m:
            return m.group("session")
    return None


def model_id(session_id: str, n: int) -> str:
    return f"{session_id}:train:{n}"


@dataclass(frozen=True)
class TinkerPath:
    model_id: str
    kind: str  # weights | sampler_weights
    name: str

    def __str__(self) -> str:
        return f"tinker://{self.model_id}/{self.kind}/{self.name}"

    @property
    def checkpoint_id(self) -> str:
        return f"{self.kind}/{self.name}"


def check_name(name: str, what: str = "checkpoint name") -> str:
    if not isinstance(name, str) or not NAME.match(name) or name in (".", ".."):
        raise PathError(f"{what} {name!r}: 1-128 letters, digits, '.', '_' or '-', starting with a letter or digit")
    return name


def parse_path(text: str, kind: str | None = None) -> TinkerPath:
    """`tinker://<model>/<kind>/<name>`; `kind` when only one is allowed here."""
    if not isinstance(text, str) or not text.startswith("tinker://"):
        raise PathError(f"{text!r} is not a tinker:// path")
    parts = text[len("tinker://"):].split("/")
    if len(parts) != 3 or not MODEL.match(parts[0]) or parts[1] not in KINDS:
        raise PathError(f"{text!r}: expected tinker://<training run id>/weights|sampler_weights|external_weights/<name>")
    if kind is not None and parts[1] != kind:
        raise PathError(f"{text!r}: expected a {kind} path (tinker://<run>/{kind}/<name>)")
    return TinkerPath(parts[0], parts[1], check_name(parts[2]))


def parse_checkpoint_id(checkpoint_id: str) -> tuple[str, str]:
    kind, _, name = checkpoint_id.partition("/")
    if kind not in KINDS:
        raise PathError(f"checkpoint id {checkpoint_id!r}: expected weights/, sampler_weights/ or external_weights/<name>")
    return kind, check_name(name)


class TenantCheckpoints:
    """The Tinker checkpoints and training runs under one tenant's storage URL."""

    def __init__(self, storage_url: str):
        self.root = join_url(storage_url, "tinker")

    def run_url(self, model: str) -> str:
        if not MODEL.match(model):
            raise PathError(f"training run id {model!r} is malformed")
        return join_url(self.root, model)

    def url(self, path: TinkerPath) -> str:
        return join_url(self.run_url(path.model_id), path.kind, path.name)

    def exists(self, path: TinkerPath) -> bool:
        return self._manifest(self.url(path)) is not None

    @staticmethod
    def _manifest(url: str) -> dict[str, Any] | None:
        return live_manifest(url)

    # -- training runs --------------------------------------------------------------------
    def write_run(self, model: str, record: dict[str, Any]) -> None:
        fs, path = url_to_fs(join_url(self.run_url(model), RUN_FILE))
        makedirs(fs, path.rsplit("/", 1)[0])
        with fs.open(path, "w") as f:
            json.dump(record, f)

    def read_run(self, model: str) -> dict[str, Any]:
        fs, path = url_to_fs(join_url(self.run_url(model), RUN_FILE))
        try:
            return json.loads(fs.cat_file(path))
        except (FileNotFoundError, ValueError):
            raise NotFound(f"no training run {model!r}") from None

    def run_ids(self, prefix: str = "") -> list[str]:
        """The tenant's training run ids (those starting with `prefix`), from the folder names alone."""
        fs, root = url_to_fs(self.root)
        fs.invalidate_cache(root)
        if not fs.exists(root):
            return []
        names = (entry.rstrip("/").rsplit("/", 1)[-1] for entry in fs.ls(root, detail=False))
        return sorted(n for n in names if MODEL.match(n) and n.startswith(prefix))

    def runs(self) -> list[dict[str, Any]]:
        out = []
        for name in self.run_ids():
            try:
                out.append(self.training_run(name))
            except NotFound:
                continue
        return sorted(out, key=lambda r: r["last_request_time"], reverse=True)

    def training_run(self, model: str) -> dict[str, Any]:
        """The SDK's TrainingRun for a run of this tenant."""
        record = self.read_run(model)
        found = self.checkpoints(model)
        last = {kind: max((c for c in found if c["checkpoint_type"] == KINDS[kind]), key=lambda c: c["time"], default=None)
                for kind in KINDS}
        return {"training_run_id": model, "base_model": record["base_model"], "model_owner": record["owner"], "is_lora": True,
                "corrupted": False, "lora_rank": record.get("lora_rank"), "user_metadata": record.get("user_metadata") or None,
                "last_request_time": record.get("last_request_time") or record["created"],
                "last_checkpoint": last["weights"], "last_sampler_checkpoint": last["sampler_weights"]}

    # -- checkpoints ----------------------------------------------------------------------
    def checkpoints(self, model: str) -> list[dict[str, Any]]:
        """The run's complete checkpoints as the SDK's Checkpoint records, oldest first."""
        run = self.run_url(model)
        out = []
        for kind, kind_name in KINDS.items():
            folder = join_url(run, kind)
            fs, local = url_to_fs(folder)
            fs.invalidate_cache(local)
            if not fs.exists(local):
                continue
            for entry in fs.ls(local, detail=False):
                name = entry.rstrip("/").rsplit("/", 1)[-1]
                if not NAME.match(name):
                    continue
                manifest = self._manifest(join_url(folder, name))
                if manifest is None:
                    continue
                path = TinkerPath(model, kind, name)
                expires = manifest.get("expires_at")
                out.append({"checkpoint_id": path.checkpoint_id, "checkpoint_type": kind_name, "tinker_path": str(path),
                            "time": _iso(manifest["time"]), "size_bytes": sum(manifest["files"].values()), "public": False,
                            "user_metadata": manifest.get("user_metadata") or None, "expires_at": expires})
        return sorted(out, key=lambda c: c["time"])

    def policy_info(self, path: TinkerPath) -> dict[str, Any]:
        """The checkpoint's policy.json (base model, adapter shape)."""
        url = self.url(path)
        if self._manifest(url) is None:
            raise NotFound(f"no checkpoint {path}")
        fs, local = url_to_fs(join_url(url, "policy.json"))
        return json.loads(fs.cat_file(local))

    def files(self, path: TinkerPath) -> dict[str, int]:
        """The committed files of a checkpoint and their sizes."""
        manifest = self._manifest(self.url(path))
        if manifest is None:
            raise NotFound(f"no checkpoint {path}")
        return dict(manifest["files"])

    def read(self, path: TinkerPath, name: str) -> bytes:
        """One committed file of a checkpoint, checked against its sha256."""
        import hashlib

        manifest = self._manifest(self.url(path))
        if manifest is None or name not in manifest["files"]:
            raise NotFound(f"no file {name!r} in {path}")
        fs, local = url_to_fs(join_url(self.url(path), name))
        data = fs.cat_file(local)
        if hashlib.sha256(data).hexdigest() != manifest["sha256"][name]:
            raise NotFound(f"{path}: {name} differs from its commit record (corrupt)")
        return data

    def set_ttl(self, path: TinkerPath, ttl_seconds: int | None) -> str | None:
        """Expire the checkpoint `ttl_seconds` from now, or never (None); the new `expires_at`."""
        if ttl_seconds is not None:
            low, high = TTL_RANGE_S
            if isinstance(ttl_seconds, bool) or not isinstance(ttl_seconds, int) or not low <= ttl_seconds <= high:
                raise PathError(f"ttl_seconds {ttl_seconds!r}: a whole number of seconds from {low} (an hour) to {high} (ten years), or null")
        if not self.exists(path):
            raise NotFound(f"no checkpoint {path}")
        expires = iso_in(float(ttl_seconds)) if ttl_seconds is not None else None
        try:
            update_manifest(self.url(path), {"expires_at": expires})
        except FileNotFoundError:
            raise NotFound(f"no checkpoint {path}") from None
        return expires

    def delete(self, path: TinkerPath) -> None:
        if not self.exists(path):
            raise NotFound(f"no checkpoint {path}")
        remove_committed(self.url(path))

    def remove_run(self, model: str) -> None:
        """The run's folder, run.json and all: it leaves the listing (for a run with no checkpoint left
        whose session has ended: nothing can save to it again)."""
        fs, path = url_to_fs(self.run_url(model))
        fs.invalidate_cache(path)
        if fs.exists(path):
            fs.rm(path, recursive=True)


def live_manifest(url: str) -> dict[str, Any] | None:
    """A checkpoint's commit record, or None when it has none or its TTL (`ttl_seconds` at save)
    has passed: an expired checkpoint is deleted when next seen, and is gone for every route."""
    manifest = committed_manifest(url)
    expires = manifest.get("expires_at") if manifest else None
    if expires and datetime.fromisoformat(expires) <= datetime.now(timezone.utc):
        remove_committed(url)
        return None
    return manifest


def _iso(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, tz=timezone.utc).isoformat()


def now_iso() -> str:
    return datetime.now(timezone.utc).isoformat()


def iso_in(seconds: float) -> str:
    return datetime.fromtimestamp(datetime.now(timezone.utc).timestamp() + seconds, tz=timezone.utc).isoformat()
