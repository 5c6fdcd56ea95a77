"""Commands that read sweeps already run: `list`, `show`, `export`, `report`, `ui` (no Ray)."""

from __future__ import annotations

from typing import Annotated

import typer

from sweeper.answer.fold import say
from sweeper.cli.app import (
    UI_PORT,
    ResultsDirOpt,
    SweepIdArg,
    app,
    console,
    err,
    fail,
    found_sweep,
    frame_of,
)
from sweeper.space.errors import SpaceError


@app.command("list")
def list_(results_dir: ResultsDirOpt = None) -> None:
    """The sweeps in the results folder, newest first: state, trials, best."""
    from sweeper.answer.console import sweeps_table
    from sweeper.record.manifest import default_results_dir, list_sweeps

    where = results_dir or default_results_dir()
    found = list_sweeps(where)
    if not found:
        console.print(f"no sweeps under {where} (`--results-dir` says where to look)")
        return
    console.print(sweeps_table(found))


@app.command()
def show(
    sweep_id: SweepIdArg,
    results_dir: ResultsDirOpt = None,
) -> None:
    """A sweep's trials, notes, and where its records are."""
    from sweeper.answer.console import print_sweep

    found = found_sweep(sweep_id, results_dir)
    assert found.manifest is not None
    print_sweep(found.manifest, frame_of(found), found.path)


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
    from sweeper.answer.export import FORMATS, export_trial

    if fmt not in FORMATS:
        fail(f"--format {fmt!r}: use one of {', '.join(FORMATS)}")
    found = found_sweep(sweep_id, results_dir)
    try:
        text = export_trial(found, frame_of(found), trial, fmt)
    except SpaceError as exc:
        fail(str(exc))
    console.file.write(text)


@app.command()
def report(
    sweep_id: SweepIdArg,
    results_dir: ResultsDirOpt = None,
) -> None:
    """Write the sweep's HTML report again (report.html in its folder) and print its path."""
    from sweeper.answer import report as reports
    from sweeper.answer.recover import study_of

    found = found_sweep(sweep_id, results_dir)
    manifest = found.manifest
    assert manifest is not None
    objective = manifest.space.objective.primary
    study, missing = study_of(found)
    for note in missing:
        say(err, note, "[yellow]note[/yellow] ")
    try:
        path = reports.write_report(
            found.path,
            frame_of(found),
            title=f"{manifest.space.name}: sweep {manifest.sweep_id}",
            metric=objective.metric,
            maximize=objective.mode == "max",
            notes=[*manifest.ending.notes, *missing],
            importances=reports.importances_of(study, manifest.sweep_id) if study else {},
        )
    except OSError as exc:
        fail(f"{found.path}: the report could not be written ({exc.strerror or exc})")
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
    from sweeper.answer.ui import serve
    from sweeper.record.manifest import default_results_dir, list_sweeps

    if sweep_id is None:
        latest = [s for s in list_sweeps(results_dir) if s.manifest is not None]
        if not latest:
            fail(f"no sweeps under {results_dir or default_results_dir()}")
        sweep_id = latest[0].sweep_id
    found = found_sweep(sweep_id, results_dir)
    assert found.manifest is not None
    try:
        serve(found.manifest, port, lambda line: say(console, line))  # a URL whole, to open
    except (SpaceError, ConnectionError) as exc:
        fail(str(exc))
