"""The job states users see: QUEUED, RUNNING, COMPLETED, FAILED, CANCELLED (the scheduler maps
Prefect's states onto them); these three end a job."""

TERMINAL = ("COMPLETED", "FAILED", "CANCELLED")
