"""Evaluation of trained models: challenger against champion, and promotion."""
