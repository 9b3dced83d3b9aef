"""Geometry3k-style "find x" problems with diagrams (generated, or Geometry3k itself via `load_geometry3k`)."""

from envs.geometry.data import load_geometry3k
from envs.geometry.game import GeometryGame, generate_problem
from envs.geometry.render import FAMILIES, render

__all__ = ["FAMILIES", "GeometryGame", "generate_problem", "load_geometry3k", "render"]
