"""Prefect flows, one per job kind: rl_train, self_play, sft, inference (serve-model) and evaluate (evaluate-promote)."""
