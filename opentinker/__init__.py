"""OpenTinker: agentic reinforcement learning as a service."""

__version__ = "0.1.0"
