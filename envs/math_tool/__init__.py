"""Multi-turn arithmetic with a calculator tool called as `<calc>EXPRESSION</calc>`."""

from envs.math_tool.calculator import CalcError, calculate, format_number, safe_eval
from envs.math_tool.game import MathToolGame

__all__ = ["CalcError", "MathToolGame", "calculate", "format_number", "safe_eval"]
