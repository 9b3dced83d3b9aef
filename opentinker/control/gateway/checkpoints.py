"""A tenant's job checkpoints through the gateway: list a job's step folders, each with whether it
is valid and otherwise the one-line reason resume skips it, and delete one step (to free space, or
to drop a folder that is not the job's). TenantJobs checks first that the job is the tenant's, so
another tenant's job reads like a missing one; only folders under the tenant's storage are touched.
"""

from __future__ import annotations

from typing import Any

from opentinker.core.ids import InvalidJobId, check_folder_name
from opentinker.storage.committed import join_url, remove_committed
from opentinker.storage.signing import CheckpointRef, Owner, checked, step_folders


def job_folders(job_id: str, spec: dict[str, Any]) -> list[tuple[str | None, str]]:
    """(agent, folder) pairs a job's checkpoints may lie in: `<job_id>`, and `<job_id>.<player>`
    for each player of a self-play job (those that do not learn have none)."""
    players = (spec.get("multiagent") or {}).get("players") or []
    pairs = [(None, job_id)] + [(p, f"{job_id}.{p}") for p in players if isinstance(p, str)]
    out = []
    for agent, folder in pairs:
        try:
            out.append((agent, check_folder_name(folder, "job id")))
        except InvalidJobId:
            continue
    return out


def _folders(storage_url: str, job_id: str, spec: dict[str, Any]) -> list[tuple[str | None, str, CheckpointRef]]:
    return [(agent, folder, ref) for agent, folder in job_folders(job_id, spec) for ref in step_folders(join_url(storage_url, folder))]


def listed(storage_url: str, tenant: str, job_id: str, spec: dict[str, Any], secret: str) -> list[dict[str, Any]]:
    """Every step folder of the job, oldest first. `valid`: its COMMIT.json is this job's, signed
    with `secret`, and every file has its recorded size (the bytes are checked against their sha256 on load)."""
    out = []
    for agent, folder, ref in _folders(storage_url, job_id, spec):
        manifest, problem = checked(ref.url, Owner(folder, tenant), secret)  # manifest None: not committed
        out.append({"step": ref.step, "agent": agent, "url": ref.url, "valid": problem is None, "problem": problem,
                    "time": manifest.get("time") if manifest else None,
                    "bytes": sum(manifest["files"].values()) if manifest else None})
    return out


def delete(storage_url: str, job_id: str, spec: dict[str, Any], step: int) -> list[str]:
    """Remove the job's folders of `step` (every agent's), uncommitted first; the URLs removed."""
    urls = [ref.url for _, _, ref in _folders(storage_url, job_id, spec) if ref.step == step]
    for url in urls:
        remove_committed(url)
    return urls
