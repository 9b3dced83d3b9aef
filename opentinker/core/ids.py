"""Job ids: fresh ones, and the one rule every given id is checked against.

A job id becomes a folder (`<checkpoint.base_url>/<job_id>/`), an S3 key part, a Prefect tag, a Ray
actor name and a value inside MLflow filter strings, so it must be one harmless path component.
The rule is the gateway's (`JobSpec.job_id` has the same pattern): 1-64 letters, digits, `.`,
`_` or `-`, starting with a letter or digit. So no `/` or `\\`, no `.`/`..` component, no NUL, no
newline or other control character, no space or quote. Every entry point that takes a job id
(`opentinker run/train/sft/follow --job-id`, RLJob, SelfPlayJob, SFTJob, Policy, the flows,
submit_job, run_inference) checks it with `check_job_id` before anything is written.
"""

from __future__ import annotations

import re
import time
import unicodedata
import uuid
from typing import Any

JOB_ID_MAX = 64
JOB_ID_PATTERN = rf"[A-Za-z0-9][A-Za-z0-9_.-]{{0,{JOB_ID_MAX - 1}}}"  # matched whole (fullmatch)
JOB_ID_RULE = f"1-{JOB_ID_MAX} letters, digits, '.', '_' or '-', starting with a letter or digit"
_JOB_ID = re.compile(JOB_ID_PATTERN)


class InvalidJobId(ValueError):
    """A job id that breaks the rule; the message is one line naming the argument and the reason."""


def shown(value: Any, limit: int = 40) -> str:
    """`value` as one printable line (its repr: a newline reads `\\n`, a NUL `\\x00`), cut to `limit` characters."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _reason(value: Any) -> str:
    if not isinstance(value, str):
        return f"must be a string, not {type(value).__name__}"
    if not value:
        return "is empty"
    if bad := next((c for c in value if unicodedata.category(c)[0] == "C"), None):
        return f"contains the control or invisible character {bad!r}"
    if "/" in value or "\\" in value:
        return "contains a path separator ('/' or '\\')"
    if len(value) > JOB_ID_MAX:
        return f"is {len(value)} characters long, the most is {JOB_ID_MAX}"
    if not value[0].isascii() or not value[0].isalnum():
        return f"starts with {value[0]!r}, not an ASCII letter or digit"
    bad = next(c for c in value if not (c.isascii() and (c.isalnum() or c in "_.-")))
    return f"contains {bad!r}"


def check_job_id(job_id: Any, what: str = "job id") -> str:
    """`job_id` when it follows the rule, else InvalidJobId: `<what> <id>: <reason> (job ids are …)`."""
    if isinstance(job_id, str) and _JOB_ID.fullmatch(job_id):
        return job_id
    raise InvalidJobId(f"{what} {shown(job_id)}: {_reason(job_id)} (job ids are {JOB_ID_RULE})")


def check_folder_name(value: Any, what: str) -> str:
    """`value` when it is one harmless folder name (no separator, not `.`/`..`, no control
    character), else InvalidJobId: the last guard where an id becomes a path (a self-play agent's
    `<job_id>.<player>` may be longer than a job id, so only the path rule applies here)."""
    if isinstance(value, str) and value not in ("", ".", "..") and not any(c in "/\\" or unicodedata.category(c)[0] == "C" for c in value):
        return value
    reason = "is not one folder name" if isinstance(value, str) and value in ("", ".", "..") else _reason(value)
    raise InvalidJobId(f"{what} {shown(value)}: {reason}")


def new_job_id(spec: Any = None) -> str:
    """The spec's own job id, else a fresh one that sorts by time: `job-20261123-194501-1a2b3c`."""
    return getattr(spec, "job_id", None) or f"job-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"


def job_id_for(spec: Any, job_id: str | None = None, what: str = "job_id") -> str:
    """The id a job runs under (`job_id`, else the spec's, else a fresh one), checked."""
    return check_job_id(job_id or new_job_id(spec), what)
