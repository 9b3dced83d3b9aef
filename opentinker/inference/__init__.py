"""Inference: serve a trained checkpoint behind an OpenAI-compatible API, and play the training
environment against any such server with `run_inference`.

Importing this package loads neither torch nor a model: `run_inference` runs on client machines.
"""

from opentinker.inference.pipeline import InferenceError, run_inference
from opentinker.inference.spec import InferenceSpec

__all__ = ["InferenceError", "InferenceSpec", "run_inference"]
