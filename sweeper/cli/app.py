"""The CLI's app and what its commands share: options, overrides as the Python API takes them,
and how an error a user can fix ends a command (its message, exit code 2)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, NoReturn

import typer

from sweeper.answer.fold import say
from sweeper.answer.streams import terminal
from sweeper.record.manifest import Found
from sweeper.space.errors import SpaceError
from sweeper.space.file import SpaceFileError, parse_value
from sweeper.space.load import builtin_spaces, space_overrides

if TYPE_CHECKING:
    import pandas as pd

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    rich_markup_mode="markdown",
    help="Performance sweeps for JAX training on TPU7x.",
)
VERBOSE = {"on": False}  # -v: the libraries' own output too (Ray, Tune, Optuna, MLflow)


@app.callback()
def main(
    verbose: Annotated[
        bool, typer.Option("--verbose", "-v", help="show Ray's, Tune's, Optuna's, MLflow's output")
    ] = False,
) -> None:
    """Performance sweeps for JAX training on TPU7x."""
    VERBOSE["on"] = verbose


console = terminal()
err = terminal(stderr=True)
UI_PORT = 5000  # the MLflow UI's port on 127.0.0.1

TrialsOpt = Annotated[int | None, typer.Option("--trials", help="number of trials (search.trials)")]
ConcurrencyOpt = Annotated[
    int | None, typer.Option("--concurrency", help="trials at once (search.concurrency)")
]
FidelityOpt = Annotated[
    str | None, typer.Option("--fidelity", help="auto | estimate | compile | run")
]
TargetOpt = Annotated[
    str | None, typer.Option("--target", help="local, or a TPU topology such as tpu7x:2x2x2")
]
SpaceArg = Annotated[
    str,
    typer.Argument(
        help=f"a YAML file, or a built-in space by name: {', '.join(builtin_spaces())}",
    ),
]
SetOpt = Annotated[
    list[str] | None, typer.Option("--set", help="override any space key: --set trial.steps=10")
]


def overrides(
    trials: int | None,
    concurrency: int | None,
    fidelity: str | None,
    target: str | None,
    sets: list[str] | None,
) -> dict[str, Any]:
    parsed: dict[str, Any] = {}
    for item in sets or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SpaceError(
                f"--set {item!r}: expected key=value, e.g. --set trial.steps=10", field="--set"
            )
        try:
            parsed[key.strip()] = parse_value(value)
        except SpaceFileError as exc:
            raise SpaceError(exc.message, field=f"--set {key.strip()}") from None
    # The same mapping the Python API uses; explicit flags win over --set.
    return space_overrides(
        {
            "trials": trials,
            "concurrency": concurrency,
            "fidelity": fidelity,
            "target": target,
            "set": parsed,
        }
    )


def disk_full(exc: BaseException) -> str | None:
    """Why a write failed when the failure is a full, over-quota or read-only folder (an
    OSError, or SQLite's "database or disk is full" from the Optuna or MLflow store, however
    deep in the exception's chain); None for any other failure."""
    from trainer.trial.files import UNWRITABLE

    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno in UNWRITABLE:
            return exc.strerror or str(exc)
        text = str(exc)
        if "database or disk is full" in text or "readonly database" in text:
            return "database or disk is full" if "full" in text else "read-only database"
        exc = exc.__cause__ or exc.__context__  # type: ignore[assignment]
    return None


def fail(message: str) -> NoReturn:
    # Folded to the terminal, paths and commands whole; its words as written (no markup).
    say(err, message, "[red]error:[/red] ")
    raise typer.Exit(2)


SweepIdArg = Annotated[str, typer.Argument(help="a sweep id, or its start (from `sweeper list`)")]
ResultsDirOpt = Annotated[
    Path | None,
    typer.Option("--results-dir", help="where sweeps are written (default: ./results)"),
]


def found_sweep(sweep_id: str, results_dir: Path | None) -> Found:
    from sweeper.record.manifest import find_sweep

    try:
        return find_sweep(sweep_id, results_dir)
    except SpaceError as exc:
        fail(str(exc))
    raise AssertionError  # _fail exits


def frame_of(found: Found) -> pd.DataFrame:
    """The sweep's table: summary.csv, or rebuilt from its runs when that is missing or
    damaged (said on stderr); exit 2 naming the file when neither can be read."""
    from sweeper.answer.recover import sweep_frame

    try:
        frame, said = sweep_frame(found)
    except SpaceError as exc:
        fail(str(exc))
    for note in said:
        say(err, note, "[yellow]note[/yellow] ")
    return frame
