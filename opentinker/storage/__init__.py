"""Storage: checkpoints through fsspec, the preflight of a job's storage, the model registry, and
the resolution of what a user names as a checkpoint (a URL, a job folder or a registry URI)."""
