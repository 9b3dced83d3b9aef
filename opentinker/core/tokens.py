"""Job tokens: what a job shows the servers it uses (the gateway's link, environment servers)
and what the servers it starts (inference) ask for.

A job's token is an HMAC of its id under the stack's secret, so the gateway and the job's
workers (which hold the secret) derive it without storing it, and a token opens one job's doors
only. The tenant who owns the job gets it through the gateway, to give to its own servers.
"""

from __future__ import annotations

import hashlib
import hmac

PREFIX = "otj_"


def job_token(secret: str, job_id: str) -> str:
    digest = hmac.new(secret.encode(), f"job:{job_id}".encode(), hashlib.sha256).hexdigest()
    return PREFIX + digest[:48]


def is_job_token(secret: str, job_id: str, token: str | None) -> bool:
    return bool(token) and hmac.compare_digest(job_token(secret, job_id), token)


def bearer(header: str | None) -> str | None:
    """The token of an `Authorization: Bearer <token>` header, else None."""
    if not header or not header.startswith("Bearer "):
        return None
    return header.removeprefix("Bearer ").strip() or None
