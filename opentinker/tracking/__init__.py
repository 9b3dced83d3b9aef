"""Tracking: MLflow runs (one per job, and the audit and inference runs), the metrics computed
over episodes, and transcripts. Imports no MLflow at import time, so clients can use the metric
helpers."""
