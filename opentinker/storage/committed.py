"""Folders that count only once committed: files written first, `COMMIT.json` last (each file's
size and sha256). A write killed at any point leaves a folder readers ignore, also on stores
without atomic rename (S3). No torch here: the gateway lists and deletes such folders too.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable
from typing import Any

import fsspec

COMMIT = "COMMIT.json"
SIGNATURE = "signature"  # a job checkpoint's HMAC of its own COMMIT.json (signing.py)
# Stores without folders: s3fs's makedirs would create a missing *bucket* instead of failing.
_OBJECT_STORES = {"s3", "s3a", "gs", "gcs", "abfs", "az"}


class CheckpointWriteError(OSError):
    """A checkpoint could not be written; the message names the URL, the file and the cause
    (e.g. `[Errno 28] No space left on device`). The partial folder is removed."""


def cause(err: BaseException) -> str:
    if isinstance(err, OSError) and err.errno is not None:
        return f"[Errno {err.errno}] {err.strerror or err}"
    return f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"


def remove_quietly(fs, path: str) -> None:
    try:
        if fs.exists(path):
            fs.rm(path, recursive=True)
    except Exception:  # noqa: BLE001 - best effort: without COMMIT.json it is never trusted anyway
        pass


def url_to_fs(url: str):
    """(filesystem, path without a trailing slash) for an fsspec URL."""
    fs, path = fsspec.core.url_to_fs(url)
    return fs, path.rstrip("/")


def join_url(base: str, *parts: str) -> str:
    return "/".join([base.rstrip("/"), *parts])


def makedirs(fs, path: str) -> None:
    if not _OBJECT_STORES & set(fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)):
        fs.makedirs(path, exist_ok=True)


def clear(url: str) -> None:
    """Remove the folder `url` if it is there (an earlier, uncommitted attempt at the same step)."""
    fs, path = url_to_fs(url)
    fs.invalidate_cache(path)  # s3fs caches listings: ask the store, not an old listing
    if fs.exists(path):
        fs.rm(path, recursive=True)


def write_committed(url: str, files: dict[str, bytes], header: dict[str, Any] | None = None,
                    sign: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
                    written: dict[str, tuple[int, str]] | None = None) -> None:
    """Write `files` into the folder `url` (replacing an uncommitted or older one there), then its
    COMMIT.json (sizes and sha256 of every file, plus `header`; passed through `sign` when given,
    see signing.py): the folder counts only once that last write lands. `written`: files already
    there, by name, with their size and sha256 (a sharded trainer's ranks wrote them into the
    folder they cleared first), listed too. CheckpointWriteError, with the partial folder removed,
    when a write fails."""
    fs, path = url_to_fs(url)
    already = written or {}
    manifest = {**(header or {}), "time": time.time(),
                "files": {n: len(d) for n, d in files.items()} | {n: size for n, (size, _) in already.items()},
                "sha256": {n: hashlib.sha256(d).hexdigest() for n, d in files.items()} | {n: sha for n, (_, sha) in already.items()}}
    if sign is not None:
        manifest = sign(manifest)
    name = "the folder"
    try:
        if not already:
            clear(url)
        makedirs(fs, path)
        for name, data in [*files.items(), (COMMIT, json.dumps(manifest).encode())]:
            if "/" in name:
                makedirs(fs, join_url(path, name.rsplit("/", 1)[0]))
            with fs.open(join_url(path, name), "wb") as f:
                f.write(data)
    except Exception as err:  # noqa: BLE001 - a full disk, no permission, a missing bucket: one line, no half folder
        remove_quietly(fs, path)
        raise CheckpointWriteError(f"cannot write checkpoint {url} ({name}): {cause(err)}") from err


def committed_manifest(url: str) -> dict[str, Any] | None:
    """COMMIT.json of the complete checkpoint folder at `url`, or None."""
    fs, path = url_to_fs(url)
    return read_manifest(fs, path)


def update_manifest(url: str, changes: dict[str, Any]) -> None:
    """Change header fields of a complete checkpoint's COMMIT.json (one object rewritten whole, so
    a reader sees the old record or the new one); files and hashes are never touched here."""
    fs, path = url_to_fs(url)
    manifest = read_manifest(fs, path)
    if manifest is None:
        raise FileNotFoundError(url)
    protected = {"files", "sha256", "time", SIGNATURE} & set(changes)
    if protected:
        raise ValueError(f"COMMIT.json fields {sorted(protected)} are written only with the files")
    if SIGNATURE in manifest:  # a job checkpoint's: any change would break its signature
        raise ValueError(f"{url}: a signed COMMIT.json is written only with its files")
    with fs.open(join_url(path, COMMIT), "wb") as f:
        f.write(json.dumps({**manifest, **changes}).encode())


def remove_committed(url: str) -> None:
    """Delete a checkpoint folder, uncommitting it first (a half-deleted folder is never trusted)."""
    fs, path = url_to_fs(url)
    fs.invalidate_cache(path)
    if fs.exists(join_url(path, COMMIT)):
        fs.rm(join_url(path, COMMIT))
    if fs.exists(path):
        fs.rm(path, recursive=True)


def read_manifest(fs, path: str) -> dict[str, Any] | None:
    """COMMIT.json of a complete checkpoint (every listed file has its size), else None."""
    fs.invalidate_cache(path)  # sizes from the store: a cached listing may predate a rewrite
    try:
        manifest = json.loads(fs.cat_file(join_url(path, COMMIT)))
        complete = all(fs.size(join_url(path, name)) == size for name, size in manifest["files"].items())
    except (FileNotFoundError, KeyError, ValueError, OSError, TypeError, AttributeError):
        return None
    return manifest if complete else None


def why_incomplete(fs, path: str) -> str:
    """Why `path` holds no committed checkpoint (for a folder `read_manifest` refused), said of its COMMIT.json."""
    try:
        manifest = json.loads(fs.cat_file(join_url(path, COMMIT)))
    except FileNotFoundError:
        return "none there: a write that never finished, or one still under way"
    except (ValueError, OSError) as err:
        return f"unreadable ({cause(err)})"
    try:
        for name, size in manifest["files"].items():
            if not fs.exists(join_url(path, name)):
                return f"{name}, which it lists, is missing"
            if fs.size(join_url(path, name)) != size:
                return f"{name} is not the size it records"
    except (KeyError, TypeError, AttributeError) as err:
        return f"unreadable ({cause(err)})"
    return "it changed while it was read"


def is_complete(fs, path: str) -> bool:
    """Does `path` hold a committed checkpoint (COMMIT.json, every listed file at its size)?"""
    return read_manifest(fs, path) is not None
