"""Made-up units and their factors: the model has never seen them, so only the server's `convert`
tool (envs/units/server.py) can answer; the game grades with the same table."""

from __future__ import annotations

# how many of the base unit (a "grain") one of each unit is
FACTORS = {"grain": 1, "zorb": 3, "flarn": 7, "quib": 12, "snark": 17, "blick": 24, "wump": 36, "trell": 45}


def unit(name: str) -> str:
    """A unit as the table names it ("Zorbs" -> "zorb")."""
    name = str(name).strip().lower()
    return name[:-1] if name not in FACTORS and name.endswith("s") else name


def convert(value: int, from_unit: str, to_unit: str) -> float:
    from_unit, to_unit = unit(from_unit), unit(to_unit)
    if from_unit not in FACTORS or to_unit not in FACTORS:
        unknown = from_unit if from_unit not in FACTORS else to_unit
        raise ValueError(f"unknown unit {unknown!r}; units: {', '.join(FACTORS)}")
    return value * FACTORS[from_unit] / FACTORS[to_unit]
