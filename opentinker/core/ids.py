"""Job ids."""

from __future__ import annotations

import time
import uuid
from typing import Any


def new_job_id(spec: Any = None) -> str:
    """The spec's own job id, else a fresh one that sorts by time: `job-20261123-194501-1a2b3c`."""
    return getattr(spec, "job_id", None) or f"job-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"
