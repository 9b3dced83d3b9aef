"""Job checkpoints bound to their job: COMMIT.json names the job, the tenant and the step, and an
HMAC with the stack's secret covers the whole manifest (every file's size and sha256 included).

Without it a folder copied from another job or tenant loads as this job's, and a manifest re-hashed
over other bytes passes the sha256 checks. With it: a foreign folder, one moved to another step, a
re-hashed or hand-edited manifest, or one written before checkpoints were signed is refused with one
line naming the folder. No torch here: the gateway lists a job's step folders with it too.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
from dataclasses import dataclass
from typing import Any

from opentinker.storage.committed import COMMIT, SIGNATURE, join_url, read_manifest, url_to_fs, why_incomplete

STEP_DIR = re.compile(r"step-(\d{8})$")


@dataclass
class CheckpointRef:
    url: str
    step: int


@dataclass(frozen=True)
class Owner:
    """Whose checkpoints a folder holds: the job's folder name (a self-play learner's is
    `<job_id>.<agent>`) and its tenant (None: the operator's own jobs, `opentinker run`)."""

    job: str
    tenant: str | None = None

    def header(self, step: int) -> dict[str, Any]:
        return {"job": self.job, "tenant": self.tenant, "step": step}


def stack_secret() -> str:
    from opentinker.core.settings import get_settings

    return get_settings().stack_secret()


def signature(manifest: dict[str, Any], secret: str) -> str:
    """HMAC-SHA256 over the manifest's canonical JSON (every field but the signature)."""
    body = json.dumps({k: v for k, v in manifest.items() if k != SIGNATURE}, sort_keys=True, separators=(",", ":"))
    return hmac.new(secret.encode(), f"checkpoint:{body}".encode(), hashlib.sha256).hexdigest()


def signed(manifest: dict[str, Any], secret: str | None = None) -> dict[str, Any]:
    return {**manifest, SIGNATURE: signature(manifest, secret or stack_secret())}


def problem(url: str, manifest: dict[str, Any], owner: Owner | None = None, secret: str | None = None) -> str | None:
    """Why the committed folder `url` must not be trusted, as one line naming it; None when it may.
    With `owner`, it must be that job's (signed, for that job and tenant, for its folder's step);
    without, only a manifest that is signed or names a job is checked (Tinker's are neither)."""
    if owner is None and SIGNATURE not in manifest and "job" not in manifest:
        return None
    given = manifest.get(SIGNATURE)
    if not isinstance(given, str):
        return (f"{url}: refused: its {COMMIT} is not signed (written before checkpoints were signed, "
                "or by hand); delete it or use a new job id")
    if not hmac.compare_digest(given, signature(manifest, secret or stack_secret())):
        return f"{url}: refused: its {COMMIT} does not match its signature (changed after the commit, or written by another stack)"
    if owner is None:
        return None
    if manifest.get("job") != owner.job or manifest.get("tenant") != owner.tenant:
        return f"{url}: refused: it belongs to another job or tenant, not to job {owner.job} (copied here from elsewhere)"
    m = STEP_DIR.search(url.rstrip("/"))
    if m is None or manifest.get("step") != int(m.group(1)):
        return f"{url}: refused: it was written as step {manifest.get('step')}, not as this folder's step (moved or renamed)"
    return None


def checked(url: str, owner: Owner | None = None, secret: str | None = None) -> tuple[dict[str, Any] | None, str | None]:
    """(COMMIT.json of the folder at `url` or None, `problem` with it or why it is not committed at
    all): one read of the manifest, which the files' sha256 checks use when they are read."""
    fs, path = url_to_fs(url)
    manifest = read_manifest(fs, path)
    if manifest is None:
        return None, f"{url} is not a complete checkpoint (no valid {COMMIT}: {why_incomplete(fs, path)})"
    return manifest, problem(url, manifest, owner, secret)


def folder_problem(url: str, owner: Owner | None = None, secret: str | None = None) -> str | None:
    """Why the folder at `url` must not be trusted (see `checked`), or None."""
    return checked(url, owner, secret)[1]


def step_folders(job_url: str) -> list[CheckpointRef]:
    """Every `step-N` folder under a job's folder, committed or not, oldest first."""
    fs, root = url_to_fs(job_url)
    fs.invalidate_cache(root)  # before exists(): s3fs answers it from a cached parent listing
    if not fs.exists(root):
        return []
    found = (STEP_DIR.search(entry.rstrip("/")) for entry in fs.ls(root, detail=False))
    return sorted((CheckpointRef(url=join_url(job_url, m.group(0)), step=int(m.group(1))) for m in found if m), key=lambda c: c.step)
