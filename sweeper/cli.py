"""`sweeper run SPACE` and `sweeper validate SPACE`: parse, call the library, print."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from sweeper.space import (
    SpaceError,
    count_points,
    load_space,
    space_overrides,
)
from sweeper.spacefile import SpaceFileError, parse_value

if TYPE_CHECKING:
    from sweeper.space import Space
    from sweeper.sweep import SweepResult

app = typer.Typer(
    add_completion=False, no_args_is_help=True, help="Performance sweeps for JAX training on TPU7x."
)
console = Console()
err = Console(stderr=True)

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
SetOpt = Annotated[
    list[str] | None, typer.Option("--set", help="override any space key: --set trial.steps=10")
]


def _overrides(
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


def _fail(message: str) -> None:
    err.print(f"[red]error:[/red] {message}")
    raise typer.Exit(2)


@app.command()
def validate(
    space: Annotated[
        str, typer.Argument(help="a YAML file, or a built-in space name (smoke, moe_short)")
    ],
    trials: TrialsOpt = None,
    concurrency: ConcurrencyOpt = None,
    fidelity: FidelityOpt = None,
    target: TargetOpt = None,
    set_: SetOpt = None,
) -> None:
    """Check a space (schema, knob values, sampler, fidelity) and count its points."""
    from sweeper.engine import check_space

    try:
        loaded = load_space(space, _overrides(trials, concurrency, fidelity, target, set_))
        pinned, notes = check_space(loaded)
    except (SpaceError, ValueError) as exc:
        _fail(str(exc))
    points = count_points(pinned)
    table = Table(title=f"space {pinned.name}: {pinned.description}")
    for col in ("knob", "kind", "values", "when"):
        table.add_column(col)
    for key, knob in pinned.knobs.items():
        values = (
            knob.values
            if knob.values is not None
            else f"[{knob.low}, {knob.high}]{' log' if knob.log else ''}"
        )
        table.add_row(key, knob.kind, str(values), str(knob.when or ""))
    console.print(table)
    for note in notes:
        console.print(f"[yellow]inert[/yellow] {note}")
    if loaded.target != "local" and loaded.fidelity in ("run", "auto"):
        console.print(
            f"[yellow]cluster[/yellow] fidelity {loaded.fidelity} on {loaded.target}: whether the Ray "
            "cluster has such a slice is checked when the sweep starts (auto compiles if it has none)"
        )
    console.print(
        f"ok: {points if points is not None else 'continuous (infinitely many)'} points; "
        f"{pinned.search.trials} trials with {pinned.search.sampler}; target {pinned.target}, fidelity {pinned.fidelity}"
    )


@app.command()
def run(
    space: Annotated[
        str, typer.Argument(help="a YAML file, or a built-in space name (smoke, moe_short)")
    ],
    trials: TrialsOpt = None,
    concurrency: ConcurrencyOpt = None,
    fidelity: FidelityOpt = None,
    target: TargetOpt = None,
    set_: SetOpt = None,
    tracking_uri: Annotated[
        str | None,
        typer.Option(
            "--tracking-uri",
            envvar="MLFLOW_TRACKING_URI",
            help="MLflow server; default sqlite under results/",
        ),
    ] = None,
    results_dir: Annotated[
        Path | None,
        typer.Option(
            "--results-dir", help="where sweeps write (default: the repository's results/)"
        ),
    ] = None,
    address: Annotated[
        str | None,
        typer.Option(
            "--address",
            help="an existing Ray cluster, e.g. auto or ray://head:10001 (default: a private local Ray)",
        ),
    ] = None,
    storage: Annotated[
        str | None,
        typer.Option(
            "--storage",
            help="a path every Ray node sees (shared filesystem or bucket): Tune state and the "
            "convergence cache (default: --results-dir)",
        ),
    ] = None,
    study: Annotated[
        str | None,
        typer.Option(
            "--study",
            help="continue this Optuna study (learn from, and reuse, its earlier sweeps' trials)",
        ),
    ] = None,
) -> None:
    """Run a sweep: Ray Tune trials, Optuna search, MLflow records."""
    try:
        loaded = load_space(space, _overrides(trials, concurrency, fidelity, target, set_))
    except SpaceError as exc:
        _fail(str(exc))
    _drive(
        dict(space=loaded, results_dir=results_dir, tracking_uri=tracking_uri, storage=storage,
             study=study),
        address,
    )  # fmt: skip


@app.command()
def resume(
    sweep_id: Annotated[str, typer.Argument(help="the sweep id `sweeper run` printed")],
    tracking_uri: Annotated[
        str | None,
        typer.Option(
            "--tracking-uri", help="where the sweep's MLflow runs are (default: as it began)"
        ),
    ] = None,
    results_dir: Annotated[
        Path | None, typer.Option("--results-dir", help="where the sweep was written")
    ] = None,
    address: Annotated[
        str | None, typer.Option("--address", help="the Ray cluster (default: a private local Ray)")
    ] = None,
) -> None:
    """Continue a sweep whose driver died or was stopped: nothing finished runs again."""
    _drive(dict(resume=sweep_id, results_dir=results_dir, tracking_uri=tracking_uri), address)


def _drive(kwargs: dict[str, Any], address: str | None) -> None:
    """Start Ray, run (or resume) the sweep with progress, print it; exit 2 / 130 as due."""
    import os
    import signal

    from sweeper.engine import start_ray
    from sweeper.sweep import run_sweep

    try:
        start_ray(address)
        # SIGTERM takes Ctrl-C's path: Tune stops the trials, and every record is closed.
        # Installed after Ray starts: ray.init installs a SIGTERM handler that aborts.
        signal.signal(signal.SIGTERM, lambda *_: os.kill(os.getpid(), signal.SIGINT))
        result = run_sweep(progress=True, **kwargs)
    except (SpaceError, ConnectionError) as exc:
        _fail(str(exc))
    except KeyboardInterrupt:
        err.print("[red]interrupted[/red] before the first trial started; nothing was run")
        raise typer.Exit(130) from None
    assert result.space_used is not None, "set when the sweep finishes"
    _print_result(result, result.space_used)
    if result.interrupted:
        err.print(
            "[red]interrupted[/red]: finished trials are kept; running ones were killed. "
            f"Continue with `sweeper resume {result.sweep_id}`"
        )
        raise typer.Exit(130)


@app.command()
def plan(
    model: Annotated[
        str, typer.Option("--model", help="a model preset, e.g. llama3-8b, mixtral-8x7b")
    ],
    seq: Annotated[int, typer.Option("--seq", help="sequence length")] = 8192,
    target: Annotated[
        str, typer.Option("--target", help="TPU topology, e.g. tpu7x:4x4x4")
    ] = "tpu7x:4x4x4",
) -> None:
    """The guide's decision table: primary/secondary strategy with the estimates behind it."""
    from trainer.estimate.plan import recommend

    try:
        rec = recommend({"preset": model}, seq, target)
    except ValueError as exc:
        _fail(str(exc))
    console.print(
        f"[bold]{rec.workload}[/bold] on {target}: primary {rec.primary}; secondary {rec.secondary}"
    )
    console.print(f"start from mesh {rec.mesh}, remat {rec.remat}  (fidelity: estimate)")
    for reason in rec.reasons:
        console.print(f"  - {reason}")


# A results cell's convergence verdict (a bool, numpy's too, or missing) as shown.
_VERDICT: dict[Any, str] = {True: "passed", False: "failed"}


def _print_result(result: SweepResult, space: Space) -> None:
    from sweeper.results import knob_columns, missing  # after a sweep: already imported

    metric = space.objective.primary.metric
    frame = result.trials
    hardware = ", ".join(sorted({h for h in frame.get("hardware", []) if h})) or "-"
    fidelities = ", ".join(sorted({f for f in frame.get("fidelity", []) if f})) or "-"
    table = Table(
        title=f"sweep {result.sweep_id}: {result.counts}; fidelity {fidelities} on {hardware}"
    )
    knob_cols = knob_columns(frame.columns)
    # Compile/estimate trials have no measured MFU: show the roofline bound under its own name.
    mfu = "mfu" if space.effective_fidelity == "run" else "est_mfu"
    for col in ("trial", "status", metric, mfu, "convergence", *knob_cols.values()):
        table.add_column(col)
    if not frame.empty:
        ordered = frame.sort_values(
            metric, ascending=space.objective.primary.mode == "min", na_position="last"
        )
        for _, row in ordered.head(10).iterrows():
            value = row.get(metric)
            status = (
                row["status"]
                if row["status"] == "ok"
                else f"{row['status']}: {row['failure_class']}"
            )
            if not missing(row.get("reused_from")):
                status += f" (reused #{int(row['reused_from'])})"
            table.add_row(
                str(row["trial_id"]),
                status,
                "-" if missing(value) else f"{value:,.1f}",
                "-" if missing(row.get(mfu)) else f"{row[mfu]:.3f}",
                _VERDICT.get(row.get("convergence_passed"), "-"),
                *["-" if missing(row[c]) else str(row[c]) for c in knob_cols],
            )
    Console(width=max(console.width, 200)).print(table)  # wide: one row per trial, even in a pipe
    for note in result.notes:
        console.print(f"[yellow]note[/yellow] {note}")
    console.print(f"results: {result.sweep_dir}")
    from sweeper.stores import MEMORY_SCHEME

    db = result.tracking_uri
    if db.startswith(MEMORY_SCHEME):
        console.print(f"tracking records in this process's memory ({db}): gone at exit")
    else:
        console.print(
            f"compare in MLflow: mlflow ui --backend-store-uri {db}  (experiment {space.name!r})"
        )
    console.print(
        f"Optuna study {result.study_name!r} in {result.optuna_storage} (optuna-dashboard {result.optuna_storage})"
    )


if __name__ == "__main__":
    app()
