"""Arithmetic and word problems the model may solve by running Python in the sandbox."""

from envs.code_interpreter.game import CodeInterpreterMathGame

__all__ = ["CodeInterpreterMathGame"]
