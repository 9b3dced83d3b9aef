"""Unit conversions only an MCP server knows: a task that cannot be solved without its tool."""

from envs.units.game import UnitsGame

__all__ = ["UnitsGame"]
