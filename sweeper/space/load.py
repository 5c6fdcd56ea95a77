"""Loading a space: a file (or a built-in space by name) read defensively, `--set` and API
overrides applied, the schema validated and every knob value checked; each error names the
file, line and field."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from sweeper.space.checks import check_knobs
from sweeper.space.errors import SpaceError
from sweeper.space.file import SpaceFileError, line_of, read_space_file
from sweeper.space.points import KEY_SEPARATOR, join_key, set_path
from sweeper.space.schema import Knob, Space
from trainer.trial.schema import first_error

SPACES_DIR = Path(__file__).resolve().parents[2] / "search_spaces"


def builtin_spaces() -> list[str]:
    """The built-in spaces' names (`search_spaces/*.yaml`), in order."""
    return sorted(p.stem for p in SPACES_DIR.glob("*.yaml"))


def resolve_path(spec: str | Path) -> Path:
    """A path, or a built-in space: a bare name (`moe_short`) or `spaces/moe_short.yaml`.

    Any other path must exist: a typo in a path never falls back to a built-in space.
    """
    path = Path(spec)
    if path.is_file():
        return path
    known = ", ".join(builtin_spaces())
    if path.exists():  # a directory, a FIFO, a device: there, but no space file
        what = (
            "is a directory"
            if path.is_dir()
            else "is not a regular file (a FIFO, device or socket)"
        )
        raise SpaceError(
            f"{what}, not a space file; give a YAML file, or a built-in space by name ({known})",
            file=str(spec),
        )
    builtin_form = path.parent == Path("spaces") and path.suffix == ".yaml"
    bare = len(path.parts) == 1 and not path.suffix
    if bare or builtin_form:
        builtin = SPACES_DIR / f"{path.stem}.yaml"
        if builtin.is_file():
            return builtin
        raise SpaceError(
            f"no built-in space named {path.stem!r} (built-in: {known})", file=str(spec)
        )
    raise SpaceError(
        f"no such file; give a YAML file, or a built-in space by name ({known})", file=str(spec)
    )


def load_space(spec: str | Path | dict[str, Any], overrides: dict[str, Any] | None = None) -> Space:
    """Load, validate and check a space; every error names file, line and field."""
    if isinstance(spec, dict):
        # No file: the space is named by its name, where it has one (a pipeline's dict).
        name = spec.get("name")
        data, root, file = copy.deepcopy(spec), None, f"space {name!r}" if name else "the space"
    else:
        path = resolve_path(spec)
        file = str(path)
        try:
            data, root = read_space_file(path)
        except SpaceFileError as exc:
            raise SpaceError(exc.message, file=file, line=exc.line) from None
        except OSError as exc:
            raise SpaceError(f"cannot read it: {exc.strerror or exc}", file=file) from None
    for key, value in (overrides or {}).items():
        set_override(data, key, value, file)
    try:
        space = Space.model_validate(data)
    except ValidationError as exc:
        loc, message = first_error(exc, Space)
        dotted = join_key(*map(str, loc))
        given = next(
            (k for k in overrides or {} if dotted == k or dotted.startswith(k + KEY_SEPARATOR)),
            None,
        )
        if given is not None:  # the value came from the command line (or the API), not the file
            raise SpaceError(
                f"{message} (as given: --set {given}={overrides[given]!r}, or its flag)",  # type: ignore[index]
                file=file,
                field=dotted,
            ) from None
        raise SpaceError(message, file=file, line=line_of(root, loc), field=dotted) from None
    check_knobs(space, root, file)
    return space


def set_override(data: dict[str, Any], dotted: str, value: Any, file: str | None = None) -> None:
    """`--set` / API override of any space key; knob names contain the separator, so
    `knobs.mesh.tensor.values=[1,2]` addresses the knob `mesh.tensor`: an existing one, or a
    new one (by a field of it, as here, or whole: `knobs.mesh.tensor={values: [1, 2]}`)."""
    if not dotted or any(not part for part in dotted.split(KEY_SEPARATOR)):
        raise SpaceError(
            f"{dotted!r} is not a dotted key such as trial.steps", file=file, field="--set"
        )
    if dotted.startswith("knobs" + KEY_SEPARATOR):
        knobs = data.setdefault("knobs", {})
        if not isinstance(knobs, dict):
            raise SpaceError("knobs is not a mapping", file=file, field="knobs")
        rest = dotted.removeprefix("knobs" + KEY_SEPARATOR)
        name = max(
            (k for k in knobs if rest == k or rest.startswith(k + KEY_SEPARATOR)),
            key=len,
            default=rest,
        )
        field = rest.rsplit(KEY_SEPARATOR, 1)
        if name == rest and len(field) == 2 and field[1] in Knob.model_fields:
            knobs[field[0]] = {field[1]: value}  # a new knob by one of its fields: NAME.values=...
        elif name == rest:
            knobs[name] = value
        else:
            if not isinstance(knobs[name], dict):
                raise SpaceError(
                    f"knob {name!r} is not a mapping", file=file, field=f"knobs.{name}"
                )
            set_path(knobs[name], rest.removeprefix(name + KEY_SEPARATOR), value)
        return
    try:
        set_path(data, dotted, value)
    except SpaceError as exc:
        raise SpaceError(exc.message, file=file, field=f"--set {dotted}") from None


# Keyword overrides of run_sweep/Sweep.prepare and the space keys they set.
OVERRIDE_KEYS = {
    "trials": "search.trials",
    "concurrency": "search.concurrency",
    "sampler": "search.sampler",
    "seed": "search.seed",
    "fidelity": "fidelity",
    "target": "target",
    "devices": "devices",
}


def space_overrides(kwargs: dict[str, Any]) -> dict[str, Any]:
    """`trials=4, set={"trial.steps": 10}` -> {"search.trials": 4, "trial.steps": 10}."""
    out = dict(kwargs.pop("set", None) or {})
    for key, value in kwargs.items():
        if key not in OVERRIDE_KEYS:
            raise TypeError(
                f"unknown override {key!r}; known: {', '.join(OVERRIDE_KEYS)} or set={{'dotted.key': value}}"
            )
        if value is not None:
            out[OVERRIDE_KEYS[key]] = value
    return out
