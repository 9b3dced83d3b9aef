"""What a user names as a checkpoint, resolved to one complete checkpoint step URL."""

from __future__ import annotations

from opentinker.storage import checkpoint as ckpt


def resolve_checkpoint(uri: str) -> str:
    """A complete checkpoint's step URL for `uri`: a step folder, a job folder (its latest complete
    step) or a registry URI `models:/name@alias` / `models:/name/version`."""
    if uri.startswith("models:/"):
        from opentinker.storage.registry import resolve_model_uri

        return resolve_model_uri(uri)
    fs, path = ckpt.url_to_fs(uri)
    if ckpt.is_complete(fs, path):
        return uri.rstrip("/")
    base, _, job = uri.rstrip("/").rpartition("/")
    latest = ckpt.latest_checkpoint(base, job) if base and job not in ("", ".", "..") else None
    if latest is None:
        raise FileNotFoundError(f"{uri}: neither a complete checkpoint nor a job folder holding one")
    return latest.url
