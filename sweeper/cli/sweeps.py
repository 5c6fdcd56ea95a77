"""Commands that run sweeps: `validate` a space, `run` it, `resume` one that was cut off."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, NoReturn

import typer
from rich import box
from rich.markup import escape
from rich.table import Table

from sweeper.answer.fold import say
from sweeper.cli.app import (
    VERBOSE,
    ConcurrencyOpt,
    FidelityOpt,
    SetOpt,
    SpaceArg,
    TargetOpt,
    TrialsOpt,
    app,
    console,
    disk_full,
    err,
    fail,
    overrides,
)
from sweeper.record.manifest import MANIFEST, default_results_dir, sweeper_command
from sweeper.space.errors import SpaceError
from sweeper.space.load import load_space, resolve_path
from sweeper.space.points import condition_words, count_points, counted, in_words


@app.command()
def validate(
    space: SpaceArg,
    trials: TrialsOpt = None,
    concurrency: ConcurrencyOpt = None,
    fidelity: FidelityOpt = None,
    target: TargetOpt = None,
    set_: SetOpt = None,
) -> None:
    """Check a space (schema, knob values, sampler, fidelity) and count its points."""
    from sweeper.search.ladder import edge
    from sweeper.space.checks import check_space

    try:
        loaded = load_space(space, overrides(trials, concurrency, fidelity, target, set_))
        pinned, notes = check_space(loaded)
    except SpaceError as exc:
        # A file that could not be found is named already; a check's fault names the file
        # the space was read from (found, then).
        fail(str(exc if exc.file is not None else exc.in_file(str(resolve_path(space)))))
    except ValueError as exc:
        fail(str(exc))
    points = count_points(pinned)
    table = Table(title=f"space {pinned.name}: {pinned.description}", title_justify="left",
                  box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False,
                  collapse_padding=True)  # fmt: skip
    longest = max((len(k) for k in pinned.knobs), default=4)
    table.add_column("knob", no_wrap=True, min_width=longest)  # whole, never cut
    table.add_column("kind")
    table.add_column("values", ratio=3, overflow="fold")
    if any(knob.when for knob in pinned.knobs.values()):
        table.add_column("when", ratio=2, overflow="fold")
    for key, knob in pinned.knobs.items():
        values = (
            in_words(knob.values)
            if knob.values is not None
            else f"[{knob.low}, {knob.high}]{' log' if knob.log else ''}"
        )
        when = [condition_words(knob.when)] if len(table.columns) > 3 else []
        table.add_row(key, knob.kind, escape(values), *when)
    console.print(table)
    for note in notes:
        say(console, note, "[yellow]inert[/yellow] ")
    if not loaded.target.is_local and loaded.fidelity in ("run", "auto"):
        say(console, f"fidelity {loaded.fidelity} on {loaded.target}: whether the Ray cluster "
            "has such a slice is checked when the sweep starts (auto compiles if it has none)",
            "[yellow]cluster[/yellow] ")  # fmt: skip
    ladder = pinned.search.ladder
    what = (
        f"ladder: screen {ladder.screen or 'every point'} by the estimate, compile the best "
        f"{ladder.verify} (and fast ones within {edge(pinned):.0%} of the memory limit), "
        f"write the best {ladder.run} as a run rung"
        if ladder
        else f"{counted(pinned.search.trials, 'trial')} with {pinned.search.sampler}"
    )
    again = pinned.search.remeasure_count(pinned.effective_fidelity)
    if again and not ladder:
        what += f", then the best {counted(again, 'point')} measured again"
    many = counted(points, "point") if points is not None else "continuous (infinitely many) points"
    fidelity = "screen, compile" if ladder else pinned.fidelity
    say(console, f"ok: {many}; {what}; target {pinned.target}, fidelity {fidelity}")


@app.command()
def run(
    space: SpaceArg,
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
            help="MLflow server (default: a SQLite file in the results folder)",
        ),
    ] = None,
    results_dir: Annotated[
        Path | None,
        typer.Option("--results-dir", help="where sweeps write (default: ./results)"),
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
    executor: Annotated[
        str,
        typer.Option(
            "--executor",
            help="ray: Ray Tune schedules the trials (a private local Ray, or --address); "
            "host: one trial at a time on this host, no Ray (one TPU VM; a host where Ray "
            "cannot start); auto: ray, unless this host allows no TCP socket",
        ),
    ] = "auto",
) -> None:
    """Run a sweep: trials scheduled by Ray Tune (or, without Ray, one at a time on this
    host), Optuna search, MLflow records."""
    try:
        loaded = load_space(space, overrides(trials, concurrency, fidelity, target, set_))
    except SpaceError as exc:
        fail(str(exc))
    if address and executor == "host":
        fail("--address names a Ray cluster and --executor host runs without Ray: give one")
    _drive(
        dict(space=loaded, results_dir=results_dir, tracking_uri=tracking_uri, storage=storage,
             study=study, executor="ray" if address else executor),
        address,
        str(resolve_path(space)),
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


def _unwritable(full: str, folder: Path | None) -> NoReturn:
    """Exit 2: the results folder took no more writes; what to do about it."""
    if full == "read-only database":  # SQLite says so of a file deleted under it too
        fix = "Put back the SQLite file (optuna.db or mlflow.db) that was removed, or make it writable"
    elif "read-only" in full.lower():
        fix = "Make it writable or give another `--results-dir`"
    else:
        fix = "Free space"
    fail(
        f"the results folder ({folder or default_results_dir()}) took no more writes ({full}). "
        f"What was written before is kept. {fix}; a sweep it had begun is in "
        f"`{sweeper_command('list', results_dir=folder)}`, and `sweeper resume` of its id "
        "(with the options given here) continues it"
    )


def _resume_command(sweep_id: str, kwargs: dict[str, Any], address: str | None) -> str:
    """`sweeper resume` of this sweep with the options given that it needs again."""
    return sweeper_command(
        "resume",
        sweep_id,
        results_dir=kwargs.get("results_dir"),
        tracking_uri=kwargs.get("tracking_uri") if kwargs.get("resume") else None,
        address=address,
    )


def _drive(kwargs: dict[str, Any], address: str | None, space_file: str | None = None) -> None:
    """Start Ray, run (or resume) the sweep with progress, print it; exit 2 / 130 as due. A
    fault of the space names `space_file`, the file it was read from."""
    import os
    import signal

    from sweeper.execute.cluster import quiet, start_ray
    from sweeper.record.lock import SweepLock
    from sweeper.sweep.prepare import choose_executor
    from sweeper.sweep.result import SweepFinished, SweepInterrupted, unfinished
    from sweeper.sweep.run import run_sweep

    try:
        quiet(VERBOSE["on"])
        executor = kwargs.get("executor", "auto")
        if kwargs.get("resume"):  # a finished or running sweep is said so before Ray starts
            found = unfinished(
                kwargs["resume"], kwargs.get("results_dir"), kwargs.get("tracking_uri")
            )
            free = SweepLock(found.path, found.sweep_id)
            free.acquire("sweeper resume (checking)")
            free.release()
            assert found.manifest is not None, "unfinished reads the manifest"
            executor = found.manifest.executor
        elif executor == "auto":
            executor = choose_executor("auto", kwargs["space"])[0]
        if executor == "ray":
            start_ray(address)
        # SIGTERM takes Ctrl-C's path: Tune stops the trials, and every record is closed.
        # Installed after Ray starts: ray.init installs a SIGTERM handler that aborts.
        signal.signal(signal.SIGTERM, lambda *_: os.kill(os.getpid(), signal.SIGINT))
        result = run_sweep(progress=True, verbose=VERBOSE["on"], **kwargs)
    except SweepFinished as exc:  # resume of a sweep that ended well: nothing to do
        say(console, exc.message)
        return
    except SpaceError as exc:
        fail(str(exc.in_file(space_file) if space_file else exc))
    except ConnectionError as exc:
        fail(str(exc))
    except SweepInterrupted as exc:
        running = ", ".join(exc.running) or "none"
        say(
            err,
            f"sweep {exc.sweep_id} stopped at once (trials running: {running}; each is "
            "recorded as killed and runs again on resume). Finished trials are kept. Continue "
            f"with `{_resume_command(exc.sweep_id, kwargs, address)}`",
            "[red]interrupted[/red]: ",
        )
        raise typer.Exit(130) from None
    except KeyboardInterrupt:
        err.print("[red]interrupted[/red] before the sweep began; nothing was run")
        raise typer.Exit(130) from None
    except Exception as exc:
        full = disk_full(exc)
        if full is None:
            raise
        _unwritable(full, kwargs.get("results_dir"))
    _print_result(result, _resume_command(result.sweep_id, kwargs, address))


def _print_result(result: Any, resume: str) -> None:
    """The ended sweep's table and notes; exit 130 when it was interrupted (`resume` says how
    to continue it)."""
    from sweeper.answer.console import print_sweep
    from sweeper.record.manifest import SweepManifest

    try:
        print_sweep(
            SweepManifest.read(result.sweep_dir / MANIFEST), result.trials, result.sweep_dir
        )
    except KeyboardInterrupt:  # the sweep had ended: only its printing was cut
        show = sweeper_command("show", result.sweep_id, results_dir=result.sweep_dir.parents[1])
        say(err, f"sweep {result.sweep_id} is recorded; `{show}` prints it",
            "[red]interrupted[/red]: ")  # fmt: skip
        raise typer.Exit(130) from None
    if result.interrupted:
        say(
            err,
            f"finished trials are kept; running ones were killed. Continue with `{resume}`",
            "[red]interrupted[/red]: ",
        )
        raise typer.Exit(130)
