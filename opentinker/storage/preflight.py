"""Preflight for a job's storage: fail in one line before any training, never half-way through.

A job writes checkpoints to `checkpoint.base_url` (and transcripts, inference outputs to
`storage.base_url`) through fsspec: `file://…` or `s3://bucket/prefix` with s3fs. Credentials and
endpoints never appear in a spec; they come from the environment of the process that runs the job
(`AWS_ACCESS_KEY_ID` / `AWS_SECRET_ACCESS_KEY` or `AWS_PROFILE`, `AWS_ENDPOINT_URL_S3` for a
non-AWS S3 server). A wrong bucket, a server that does not answer or missing credentials would
otherwise surface after the model has loaded and a step has run, as a traceback from deep in
botocore; `check_storage` turns each into `storage.base_url s3://…: <reason>` up front.
"""

from __future__ import annotations

import uuid

from typing import TYPE_CHECKING

import fsspec

if TYPE_CHECKING:
    from opentinker.core.spec import BaseJobSpec

PROBE_PREFIX = ".opentinker-probe-"

# Short timeouts and one attempt: a preflight answers in seconds, not after minutes of retries.
_PROBE_OPTIONS = {"s3": {"config_kwargs": {"connect_timeout": 5, "read_timeout": 15, "retries": {"max_attempts": 1}}}}


class StorageError(RuntimeError):
    """The storage a job would write to is not usable; the message names the field, URL and why."""


def _reason(err: Exception) -> str:
    names = {cls.__name__ for cls in type(err).__mro__}
    if names & {"NoCredentialsError", "PartialCredentialsError"}:
        return ("no S3 credentials: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE) in the environment "
                "of the process that runs the job (the stack's worker gets those set when `opentinker up` ran)")
    if names & {"EndpointConnectionError", "ConnectTimeoutError", "ConnectionError"}:
        return f"storage endpoint not reachable ({err})"
    if isinstance(err, PermissionError):
        return f"access denied ({err})"
    if isinstance(err, FileNotFoundError):
        return f"bucket or folder does not exist ({err})"
    if isinstance(err, ImportError):
        return f"no filesystem for this URL ({err}); for s3:// install s3fs"
    return f"{type(err).__name__}: {err}"


def check_storage(url: str, field: str = "storage.base_url") -> None:
    """Write and delete a small probe object under `url`, or raise StorageError in one line.

    A fresh filesystem instance (no cached listings or clients) reads the environment as it is now.
    The probe's name is unique and it is removed at once, so nothing already saved is touched.
    """
    protocol = fsspec.core.split_protocol(url)[0] or "file"
    try:
        fs, path = fsspec.core.url_to_fs(url, skip_instance_cache=True, **_PROBE_OPTIONS.get(protocol, {}))
        if protocol == "file":
            fs.makedirs(path, exist_ok=True)  # object stores have no folders; a local one is made here
        probe = f"{path.rstrip('/')}/{PROBE_PREFIX}{uuid.uuid4().hex}"
        fs.pipe_file(probe, b"ok")
        fs.rm_file(probe)
    except Exception as err:  # noqa: BLE001 - every failure becomes one line naming the URL
        raise StorageError(f"{field} {url}: {_reason(err)}") from None


def check_job_storage(spec: BaseJobSpec) -> None:
    """Preflight where a job (RL or SFT) writes: its checkpoints (named after the field that set the URL)."""
    url = spec.checkpoint.base_url
    check_storage(url, "storage.base_url" if url == spec.storage.base_url else "checkpoint.base_url")
