"""Orchestration: where a job's runtime meets Prefect and Ray: the jobs in Ray actors, the task
runner that dispatches Prefect tasks onto Ray, and what every job flow shares (slots, start-up
checks, MLflow run, failure reason, registration)."""
