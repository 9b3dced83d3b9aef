"""Multi-turn arithmetic with a calculator, a declared tool the model calls in its own tool-call format."""

from envs.math_tool.calculator import CalcError, calculate, format_number, safe_eval
from envs.math_tool.game import MathToolGame

__all__ = ["CalcError", "MathToolGame", "calculate", "format_number", "safe_eval"]
