"""Prefect flows: one per job kind (rl_train now; SFT, inference and evaluation later)."""
