"""OpenTinker: agentic reinforcement learning as a service."""

__version__ = "0.1.0"


def __getattr__(name: str):
    # `from opentinker import run_inference` as in the reference design, without making every
    # `import opentinker` load the inference client.
    if name == "run_inference":
        from opentinker.inference import run_inference

        return run_inference
    raise AttributeError(f"module 'opentinker' has no attribute {name!r}")
