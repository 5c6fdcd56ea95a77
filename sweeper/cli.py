"""`sweeper run SPACE` and `sweeper validate SPACE`: parse, call the library, print."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from sweeper.manifest import MANIFEST, SUMMARY, Found
from sweeper.space import (
    SpaceError,
    count_points,
    load_space,
    space_overrides,
)
from sweeper.spacefile import SpaceFileError, parse_value

if TYPE_CHECKING:
    import pandas as pd

app = typer.Typer(
    add_completion=False, no_args_is_help=True, help="Performance sweeps for JAX training on TPU7x."
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


console = Console()
err = Console(stderr=True)
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


def disk_full(exc: BaseException) -> str | None:
    """Why a write failed when the failure is a full, over-quota or read-only folder (an
    OSError, or SQLite's "database or disk is full" from the Optuna or MLflow store, however
    deep in the exception's chain); None for any other failure."""
    from trainer.spec.files import UNWRITABLE

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


def _fail(message: str) -> None:
    err.print(f"[red]error:[/red] {message}", soft_wrap=True)  # one line: paths whole
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
    ladder = pinned.search.ladder
    what = (
        f"ladder: screen {ladder.screen or 'every point'} by the estimate, compile the best "
        f"{ladder.verify} (and fast ones within {ladder.edge:.0%} of the memory limit), "
        f"write the best {ladder.run} as a run rung"
        if ladder
        else f"{pinned.search.trials} trials with {pinned.search.sampler}"
    )
    again = pinned.search.remeasure_count(pinned.effective_fidelity)
    if again and not ladder:
        what += f", then the best {again} points measured again"
    console.print(
        f"ok: {points if points is not None else 'continuous (infinitely many)'} points; "
        f"{what}; target {pinned.target}, fidelity {'screen, compile' if ladder else pinned.fidelity}"
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

    from sweeper.engine import quiet, start_ray
    from sweeper.sweep import SweepFinished, run_sweep, unfinished

    try:
        quiet(VERBOSE["on"])
        if kwargs.get("resume"):  # a finished sweep is said so before any Ray starts
            unfinished(kwargs["resume"], kwargs.get("results_dir"), kwargs.get("tracking_uri"))
        start_ray(address)
        # SIGTERM takes Ctrl-C's path: Tune stops the trials, and every record is closed.
        # Installed after Ray starts: ray.init installs a SIGTERM handler that aborts.
        signal.signal(signal.SIGTERM, lambda *_: os.kill(os.getpid(), signal.SIGINT))
        result = run_sweep(progress=True, verbose=VERBOSE["on"], **kwargs)
    except SweepFinished as exc:  # resume of a sweep that ended well: nothing to do
        console.print(exc.message)
        return
    except (SpaceError, ConnectionError) as exc:
        _fail(str(exc))
    except KeyboardInterrupt:
        err.print("[red]interrupted[/red] before the first trial started; nothing was run")
        raise typer.Exit(130) from None
    except Exception as exc:
        full = disk_full(exc)
        if full is None:
            raise
        folder = kwargs.get("results_dir") or "./results"
        if full == "read-only database":  # SQLite says so of a file deleted under it too
            fix = "Put back the SQLite file (optuna.db or mlflow.db) that was removed, or make it writable"
        elif "read-only" in full.lower():
            fix = "Make it writable or give another `--results-dir`"
        else:
            fix = "Free space"
        _fail(
            f"the results folder ({folder}) took no more writes ({full}). What was written "
            f"before is kept. {fix}; a sweep it had begun is in `sweeper list`, and `sweeper "
            "resume ID` continues it"
        )
    from sweeper.console import print_sweep
    from sweeper.manifest import SweepManifest

    print_sweep(SweepManifest.read(result.sweep_dir / MANIFEST), result.trials, result.sweep_dir)
    if result.interrupted:
        err.print(
            "[red]interrupted[/red]: finished trials are kept; running ones were killed. "
            f"Continue with `sweeper resume {result.sweep_id}`"
        )
        raise typer.Exit(130)


@app.command()
def screen(
    space: Annotated[
        str, typer.Argument(help="a YAML file, or a built-in space name (a TPU target's)")
    ],
    sample: Annotated[
        int | None, typer.Option("--sample", min=1, help="screen this many random points")
    ] = None,
    top: Annotated[int, typer.Option("--top", min=1, help="rows to print")] = 15,
    out: Annotated[Path | None, typer.Option("--out", help="write every row as CSV")] = None,
    target: TargetOpt = None,
    set_: SetOpt = None,
) -> None:
    """Judge every point of a space by the analytic estimate, in this process (fidelity
    estimate): valid or not, fits the target's memory or not, est. tokens/s and rank."""
    import time

    from sweeper.screen import FITS, unseen_knobs
    from sweeper.screen import screen as screen_space

    try:
        loaded = load_space(space, _overrides(None, None, None, target, set_))
        started = time.perf_counter()
        frame = screen_space(loaded, sample)
    except (SpaceError, ValueError) as exc:
        _fail(str(exc))
    took = time.perf_counter() - started
    counts = frame["verdict"].value_counts().to_dict()
    knobs = [c for c in frame.columns if c.startswith("knob:")]
    table = Table(title=f"{loaded.name}: {len(frame)} points screened in {took:.2f} s "
                  f"({counts}); fidelity estimate on {loaded.target}")  # fmt: skip
    for col in (
        "rank",
        *[k.removeprefix("knob:") for k in knobs],
        "GiB/device",
        "est tokens/s/chip",
    ):
        table.add_column(col, justify="right")
    for _, row in frame.head(top).iterrows():
        fits = row["verdict"] == FITS
        gib = row.get("est_hbm_per_device_gib")
        table.add_row(
            f"{row['rank']:.0f}" if fits else row["verdict"],
            *[str(row[k]) for k in knobs],
            "-" if gib is None or gib != gib else f"{gib:.1f}",
            f"{row['est_tokens_per_sec_per_chip']:,.0f}" if fits else "-",
        )
    console.print(table)
    if "why" in frame:  # the commonest reasons points were left out
        why = frame.loc[(frame["verdict"] != FITS) & frame["why"].fillna("").ne(""), "why"]
        for reason, count in why.value_counts().head(3).items():
            console.print(f"{count} point{'s' if count > 1 else ''}: {reason}")
    unseen = unseen_knobs(frame)
    if unseen:
        console.print(
            f"note: the estimate does not tell the values of {', '.join(unseen)} apart "
            "(a compile does: fidelity compile)"
        )
    if out is not None:
        frame.to_csv(out, index=False)
        console.print(f"wrote {out}")


@app.command()
def plan(
    model: Annotated[
        str, typer.Option("--model", help="a model preset, e.g. llama3-8b, mixtral-8x7b")
    ],
    seq: Annotated[int, typer.Option("--seq", help="sequence length")] = 8192,
    target: Annotated[
        str, typer.Option("--target", help="TPU topology, e.g. tpu7x:4x4x4")
    ] = "tpu7x:4x4x4",
    space: Annotated[
        Path | None,
        typer.Option("--space", help="write a compile-fidelity space starting from the advice"),
    ] = None,
    compile_: Annotated[
        bool, typer.Option("--compile", help="compile the advice for the target (minutes)")
    ] = False,
    timeout: Annotated[float, typer.Option("--timeout", help="compile timeout, seconds")] = 3600,
) -> None:
    """Advise a mesh, remat policy and batch for a model on a target (estimates).

    Every candidate the trainer accepts is estimated; the fastest that fits is advised, with
    FP8 and batch advice. --space writes a space starting there; --compile checks it."""
    import yaml

    from sweeper.plan import compile_advice, space_for
    from trainer.estimate.plan import recommend
    from trainer.spec.hardware import Topology

    spec = {"preset": model}
    try:
        Topology.parse(target)
        rec = recommend(spec, seq, target)
    except ValueError as exc:
        _fail(str(exc))
    console.print(
        f"[bold]{rec.workload}[/bold] on {target}: primary {rec.primary}; secondary {rec.secondary}"
    )
    console.print(f"advice: {rec.best.describe()}  (fidelity: estimate)")
    for reason in rec.reasons:
        console.print(f"  - {reason}")
    table = Table(
        "mesh, remat, batch", "GiB/device", "tokens/s/chip", title="next that fit (estimate)"
    )
    for alt in rec.alternatives[:5]:
        table.add_row(alt.describe(), f"{alt.gib:.1f}", f"{alt.tokens:,.0f}")
    console.print(table)
    if space is not None:
        name = f"plan_{model}_{seq}".replace(".", "").replace("-", "_")
        space.write_text(yaml.safe_dump(space_for(rec, spec, seq, target, name), sort_keys=False))
        load_space(str(space))  # what it wrote is a space the engine takes
        console.print(f"wrote {space}: trial 0 is the advice (`sweeper run {space}`)")
    if compile_:
        with console.status(f"compiling the advice for {target} with libtpu (minutes)"):
            got = compile_advice(rec, spec, seq, target, timeout)
        if got["status"] != "ok":
            console.print(f"compile: {got['status']}: {got['message']}")
            raise typer.Exit(1)
        console.print(
            f"compile: {got['hbm_per_device_gib']:.1f} GiB per device (estimate "
            f"{rec.best.gib:.1f}), fits: {got['fits']}; {got['est_tokens_per_sec_per_chip']:,.0f} "
            f"tokens/s/chip from the compiled program (estimate, fidelity compile), "
            f"{got['compile_s']:.0f} s"
        )


SweepIdArg = Annotated[str, typer.Argument(help="a sweep id, or its start (from `sweeper list`)")]
ResultsDirOpt = Annotated[
    Path | None,
    typer.Option("--results-dir", help="where sweeps are written (default: ./results)"),
]


def _found(sweep_id: str, results_dir: Path | None) -> Found:
    from sweeper.manifest import find_sweep

    try:
        return find_sweep(sweep_id, results_dir)
    except SpaceError as exc:
        _fail(str(exc))
    raise AssertionError  # _fail exits


def _frame(found: Found) -> pd.DataFrame:
    import pandas as pd

    from sweeper.report import frame_of

    if not (found.path / SUMMARY).exists():
        return pd.DataFrame()
    return frame_of(found.path)


@app.command("list")
def list_(results_dir: ResultsDirOpt = None) -> None:
    """The sweeps in the results folder, newest first: state, trials, best."""
    from sweeper.console import sweeps_table
    from sweeper.manifest import default_results_dir, list_sweeps

    where = results_dir or default_results_dir()
    found = list_sweeps(where)
    if not found:
        console.print(f"no sweeps under {where} (`--results-dir` says where to look)")
        return
    Console(width=max(console.width, 160)).print(sweeps_table(found))


@app.command()
def show(
    sweep_id: SweepIdArg,
    results_dir: ResultsDirOpt = None,
) -> None:
    """A sweep's trials, notes, and where its records are."""
    from sweeper.console import print_sweep

    found = _found(sweep_id, results_dir)
    assert found.manifest is not None
    print_sweep(found.manifest, _frame(found), found.path)


@app.command()
def export(
    sweep_id: SweepIdArg,
    fmt: Annotated[
        str, typer.Option("--format", help="maxtext (its command line), env, or trial (JSON)")
    ] = "maxtext",
    trial: Annotated[
        str | None, typer.Option("--trial", help="a trial id (default: the sweep's best)")
    ] = None,
    results_dir: ResultsDirOpt = None,
) -> None:
    """A trial as MaxText's command line, its LIBTPU/XLA environment, or a trial config.

    The trial form is self-contained: `python -m trainer --config FILE` reruns it."""
    from sweeper.export import FORMATS, export_trial

    if fmt not in FORMATS:
        _fail(f"--format {fmt!r}: use one of {', '.join(FORMATS)}")
    found = _found(sweep_id, results_dir)
    try:
        text = export_trial(found, _frame(found), trial, fmt)
    except SpaceError as exc:
        _fail(str(exc))
    typer.echo(text, nl=False)


@app.command()
def report(
    sweep_id: SweepIdArg,
    results_dir: ResultsDirOpt = None,
) -> None:
    """Write the sweep's HTML report again (report.html in its folder) and print its path."""
    import optuna

    from sweeper import report as reports

    found = _found(sweep_id, results_dir)
    manifest = found.manifest
    assert manifest is not None
    objective = manifest.space.objective.primary
    study = optuna.load_study(study_name=manifest.study_name, storage=manifest.optuna_storage)
    path = reports.write_report(
        found.path,
        _frame(found),
        title=f"{manifest.space.name}: sweep {manifest.sweep_id}",
        metric=objective.metric,
        maximize=objective.mode == "max",
        notes=manifest.ending.notes,
        importances=reports.importances_of(study, manifest.sweep_id),
    )
    console.print(str(path))


@app.command()
def ui(
    sweep_id: Annotated[
        str | None, typer.Argument(help="a sweep id, or its start (default: the latest)")
    ] = None,
    port: Annotated[int, typer.Option("--port", help="the port on 127.0.0.1")] = UI_PORT,
    results_dir: ResultsDirOpt = None,
) -> None:
    """Open the MLflow UI on 127.0.0.1 at the sweep's runs.

    For a sweep recorded on a tracking server, its URL is printed and nothing is started."""
    from sweeper.manifest import default_results_dir, list_sweeps
    from sweeper.ui import serve

    if sweep_id is None:
        latest = [s for s in list_sweeps(results_dir) if s.manifest is not None]
        if not latest:
            _fail(f"no sweeps under {results_dir or default_results_dir()}")
        sweep_id = latest[0].sweep_id
    found = _found(sweep_id, results_dir)
    assert found.manifest is not None
    try:
        serve(found.manifest, port, lambda line: console.print(line, soft_wrap=True))
    except (SpaceError, ConnectionError) as exc:
        _fail(str(exc))


if __name__ == "__main__":
    app()
