"""Every field of every config model has a description: the docs' configuration reference is
generated from them (docs/hooks.py), so a field without one would be an undocumented key."""

from __future__ import annotations

import typing

from pydantic import BaseModel, Field

from rollart.config import RunConfig


def _models(annotation: object) -> list[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in typing.get_args(annotation) for m in _models(arg)]


def fields_without_description(root: type[BaseModel]) -> tuple[int, list[str]]:
    """(fields seen, `Model.field (key.path)` of each without a description), recursively."""
    seen: set[type[BaseModel]] = set()
    missing: list[str] = []
    count = 0

    def walk(model: type[BaseModel], path: str) -> None:
        nonlocal count
        if model in seen:
            return
        seen.add(model)
        for name, field in model.model_fields.items():
            count += 1
            key = f"{path}.{name}" if path else name
            if not (field.description or "").strip():
                missing.append(f"{model.__name__}.{name} ({key})")
            for sub in _models(field.annotation):
                walk(sub, key)

    walk(root, "")
    return count, missing


def test_every_config_field_has_a_description():
    count, missing = fields_without_description(RunConfig)
    assert count > 200  # the walk reached the nested sections
    assert not missing, "config fields without a description (add a docstring under each): " + (
        ", ".join(missing))


def test_the_check_names_a_field_without_a_description():
    class Inner(BaseModel):
        documented: int = Field(0, description="Has one.")
        bare: int = 0

    class Outer(BaseModel):
        inner: Inner = Field(Inner(), description="Nested.")

    _, missing = fields_without_description(Outer)
    assert missing == ["Inner.bare (inner.bare)"]
