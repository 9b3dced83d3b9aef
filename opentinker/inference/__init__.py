"""Inference: serve a trained checkpoint behind an OpenAI-compatible API, and play the training
environment against any such server with `run_inference`.

Importing this package loads nothing else (its names load on first use): `run_inference` runs on
client machines, and `opentinker.inference.vllm_worker` inside vLLM's own processes, where the
project's other dependencies are not installed.
"""

_EXPORTS = {"InferenceError": "opentinker.inference.pipeline", "run_inference": "opentinker.inference.pipeline",
            "InferenceSpec": "opentinker.inference.spec"}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'opentinker.inference' has no attribute {name!r}")
