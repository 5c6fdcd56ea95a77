"""The base of every typed configuration (the trial's and the engine's space), and how a
validation error reads: the dotted field at fault and what to do."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

UNKNOWN_KEY = "unknown key (remove it or check its spelling)"


class Frozen(BaseModel):
    """Immutable once validated; unknown keys are refused; each field's docstring is its doc."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)


def first_error(exc: ValidationError) -> tuple[tuple[Any, ...], str]:
    """(location, message) of a validation error's first complaint, worded for a user."""
    first = exc.errors()[0]
    if first["type"] == "extra_forbidden":
        return tuple(first["loc"]), UNKNOWN_KEY
    return tuple(first["loc"]), first["msg"].removeprefix("Value error, ")
