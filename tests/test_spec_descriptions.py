"""Every field a user can write in a spec says what it is: the generated spec reference (docs)
reads its descriptions from the models, so a field without one fails here, not in the docs."""

from __future__ import annotations

import typing

import pytest
from pydantic import BaseModel

from opentinker.core.spec import JobSpec
from opentinker.inference.spec import InferenceSpec
from opentinker.sft.spec import SFTSpec


def undescribed(model: type[BaseModel], prefix: str = "", seen: set | None = None) -> list[str]:
    """Dotted names of the fields of `model` and of every model nested in them that have no description."""
    seen = seen if seen is not None else set()
    if model in seen:
        return []
    seen.add(model)
    missing = []
    for name, field in model.model_fields.items():
        if not (field.description or "").strip():
            missing.append(prefix + name)

        def nested(t):
            yield t
            for arg in typing.get_args(t):
                yield from nested(arg)

        for t in nested(field.annotation):
            if isinstance(t, type) and issubclass(t, BaseModel):
                missing += undescribed(t, f"{prefix}{name}.", seen)
    return missing


@pytest.mark.parametrize("spec", [JobSpec, SFTSpec, InferenceSpec], ids=lambda m: m.__name__)
def test_every_spec_field_has_a_description(spec):
    assert undescribed(spec) == []


def test_the_check_sees_a_missing_description_in_a_nested_section():
    class Inner(BaseModel):
        told: int = 0

    class Outer(BaseModel):
        inner: Inner | None = None

    assert undescribed(Outer) == ["inner", "inner.told"]
