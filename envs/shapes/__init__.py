"""Coloured shapes: a visual multiple-choice task (`Answer: <letter>`) whose answer is only in the picture."""

from envs.shapes.game import ShapesGame, parse_letter, place_answer, render

__all__ = ["ShapesGame", "parse_letter", "place_answer", "render"]
