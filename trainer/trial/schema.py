"""The base of every typed configuration (the trial's and the engine's space), and how a
validation error reads: the dotted field at fault and what to do."""

from __future__ import annotations

import difflib
import types
import typing
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

UNKNOWN_KEY = "unknown key (remove it or check its spelling)"


class Frozen(BaseModel):
    """Immutable once validated; unknown keys are refused; each field's docstring is its doc."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)


def first_error(
    exc: ValidationError, model: type[BaseModel] | None = None
) -> tuple[tuple[Any, ...], str]:
    """(location, message) of a validation error's first complaint, worded for a user; for
    an unknown key of `model` (the model validated), the nearest key it has."""
    first = exc.errors()[0]
    if first["type"] == "extra_forbidden":
        near = nearest_key(model, tuple(first["loc"])) if model else None
        return tuple(first["loc"]), f"unknown key (did you mean {near}?)" if near else UNKNOWN_KEY
    return tuple(first["loc"]), first["msg"].removeprefix("Value error, ")


def nearest_key(model: type[BaseModel], loc: tuple[Any, ...]) -> str | None:
    """The key of the model at `loc[:-1]` (walked through nested models) that `loc[-1]` most
    nearly spells, or None (no such model there, or no key near)."""
    for part in loc[:-1]:
        field = model.model_fields.get(str(part))
        inner = _model_of(field.annotation) if field is not None else None
        if inner is None:
            return None
        model = inner
    keys = [*model.model_fields, *(f.alias for f in model.model_fields.values() if f.alias)]
    near = difflib.get_close_matches(str(loc[-1]), keys, n=1, cutoff=0.6)
    return near[0] if near else None


def _model_of(annotation: Any) -> type[BaseModel] | None:
    """The model an annotation holds (`X`, `X | None`), or None."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        found = [m for a in typing.get_args(annotation) if (m := _model_of(a)) is not None]
        return found[0] if len(found) == 1 else None
    return None
