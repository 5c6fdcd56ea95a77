"""docs/reference.md, generated from the schemas: trial config, sweep space, trainer events.

`python -m sweeper.reference` rewrites it; `--check` exits 1 when the file has drifted from
the code (a test runs the check).
"""

from __future__ import annotations

import sys
import types
import typing
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from sweeper.space.schema import Knob, Space
from trainer.trial.config import TrialConfig
from trainer.trial.events import Accepted, Compiled, Failure, Step, Summary
from trainer.trial.hardware import Target

REFERENCE = Path(__file__).resolve().parents[1] / "docs" / "reference.md"


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in typing.get_args(annotation) for m in _models_in(arg)]


def _type(annotation: Any) -> str:
    if annotation is Target:
        return "str"  # written as text, held parsed
    origin = typing.get_origin(annotation)
    if origin is Literal:
        return " \\| ".join(f"`{v}`" for v in typing.get_args(annotation))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type(a) for a in typing.get_args(annotation))
    if origin in (list, dict):
        return f"{origin.__name__}[{', '.join(_type(a) for a in typing.get_args(annotation))}]"
    if annotation is type(None):
        return "null"
    if annotation is Any:
        return "any"
    return getattr(annotation, "__name__", str(annotation))


def _default(field: Any) -> str:
    if field.default_factory in (list, dict):
        value = field.default_factory()
    elif field.default_factory is not None:
        return f"`{field.default_factory.__name__}()`"  # e.g. the emit time
    elif field.default is PydanticUndefined:
        return "required"
    else:
        value = field.default
    if isinstance(value, BaseModel):
        return ""
    if isinstance(value, Target):
        value = str(value)
    return f"`{value!r}`".replace("|", "\\|")


def rows(model: type[BaseModel], prefix: str = "") -> list[str]:
    """One table row per field, nested models flattened into dotted paths."""
    out = []
    for name, field in model.model_fields.items():
        nested = [m for m in _models_in(field.annotation) if m is not model]
        if nested and typing.get_origin(field.annotation) is not dict:
            for sub in nested:
                out += rows(sub, f"{prefix}{name}.")
            continue
        description = " ".join((field.description or "").split()).rstrip(".").replace("|", "\\|")
        out.append(
            f"| `{prefix}{name}` | {_type(field.annotation)} | {_default(field)} | {description} |"
        )
    return out


def table(model: type[BaseModel]) -> str:
    return "\n".join(["| field | type | default | meaning |", "|---|---|---|---|", *rows(model)])


def render() -> str:
    parts = [
        "# Reference",
        "",
        "Generated from the code by `python -m sweeper.reference`; do not edit by hand "
        "(a test fails when this file and the schemas differ).",
        "",
        "## Trial configuration (`trainer.trial.config.TrialConfig`)",
        "",
        "A space's `model` and `trial` sections, and each knob, are keys of this table.",
        "",
        table(TrialConfig),
        "",
        "### Search space knob entries (`sweeper.space.schema.Knob`)",
        "",
        table(Knob),
        "",
        "## Sweep space (`sweeper.space.schema.Space`)",
        "",
        table(Space),
        "",
        "## Trainer events (protocol `trainer.trial.events`)",
        "",
    ]
    for event in (Accepted, Compiled, Step, Summary, Failure):
        kind = event.model_fields["event"].default
        parts += [f"### `{kind}`", "", (event.__doc__ or "").strip(), "", table(event), ""]
    return "\n".join(parts).replace("\n\n\n", "\n\n")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    text = render()
    if "--check" in argv:
        if not REFERENCE.exists() or REFERENCE.read_text() != text:
            print(f"{REFERENCE} is out of date: run python -m sweeper.reference", file=sys.stderr)
            return 1
        return 0
    REFERENCE.write_text(text)
    print(f"wrote {REFERENCE}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
