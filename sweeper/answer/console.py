"""What the CLI prints about sweeps: a sweep's ranked table and notes, where its records are
and how to open them, and the list of sweeps in a results folder."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pandas as pd
from rich import box
from rich.console import Group, RenderableType
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from sweeper.answer.fold import say
from sweeper.answer.notes import UNPINNED
from sweeper.answer.streams import terminal
from sweeper.answer.table import constant_knobs, in_rank_order, searched
from sweeper.record.journal import TrackingJournal
from sweeper.record.manifest import JOURNAL, Found, SweepManifest, results_dir_of, sweeper_command
from sweeper.record.mlflow_view import runs_url
from sweeper.record.row import REMEASURED, Column, knob_columns, missing, ranking_of, short_names
from sweeper.record.stores import MEMORY_SCHEME
from sweeper.space.points import counted
from trainer.trial.events import TrialStatus

console = terminal()
# A results cell's convergence verdict (a bool, numpy's too, or missing) as shown.
_VERDICT: dict[Any, str] = {True: "passed", False: "failed"}


def served(uri: str) -> bool:
    return uri.startswith(("http://", "https://"))


# How the tables head a metric column (the metric's own name otherwise).
METRIC_LABELS = {
    "tokens_per_sec_per_chip": "tokens/s/chip",
    "est_tokens_per_sec_per_chip": "est tokens/s/chip",
    "step_time_s": "step s",
    "est_step_time_s": "est step s",
}


def metric_label(metric: str) -> str:
    return METRIC_LABELS.get(metric, metric)


def sweep_header(manifest: SweepManifest, frame: pd.DataFrame) -> list[str]:
    """The lines above the table: the sweep, its counts, fidelity and hardware, and the knobs
    that never varied (so the table shows only those that did)."""
    hardware = ", ".join(
        sorted({str(h) for h in frame.get(Column.HARDWARE, []) if not missing(h) and h})
    )
    fidelities = ", ".join(
        sorted({str(f) for f in frame.get(Column.FIDELITY, []) if not missing(f) and f})
    )
    ending = manifest.ending
    told = ending.counted() if ending.counts else f"{len(searched(frame)):,} total"
    lines = [
        f"sweep {manifest.sweep_id}: {told}; fidelity {fidelities or '-'} on {hardware or '-'}"
    ]
    same = constant_knobs(searched(frame))
    if same:
        names = short_names(same)
        lines.append(
            "same in every trial: " + ", ".join(f"{names[k]}={v}" for k, v in same.items())
        )
    return lines


def sweep_table(
    manifest: SweepManifest, frame: pd.DataFrame, rows: int = 10, width: int | None = None
) -> RenderableType:
    """The sweep's trials, best first: id, status, objective (and its re-measure), MFU,
    convergence verdict and the values of the knobs that varied, by their short names: a
    column each where they fit `width`, else one column of `name=value` words, else (too
    narrow for the longest word) each trial's words on a line below the table."""
    space = manifest.space
    metric = space.objective.primary.metric
    again = f"{REMEASURED}{metric}"  # the best points' second figure, on their first row
    frame = searched(frame)
    same = constant_knobs(frame)
    knobs = {c: n for c, n in knob_columns(frame.columns).items() if n not in same}
    names = short_names(knobs.values())
    # Compile/estimate trials have no measured MFU: show the roofline bound under its own name.
    mfu = "mfu" if space.effective_fidelity == "run" else "est_mfu"
    measured_again = bool(again in frame and frame[again].notna().any())
    heads = ["trial", "status", metric_label(metric),
             *(["again", "mean"] if measured_again else []), mfu, "conv."]  # fmt: skip
    ordered = in_rank_order(frame, space.objective.primary)
    lines = [_cells(row, metric, measured_again, mfu) for _, row in ordered.head(rows).iterrows()]
    values = [
        ["-" if missing(r[c]) else str(r[c]) for c in knobs]
        for _, r in ordered.head(rows).iterrows()
    ]
    knob_heads = [names[n] for n in knobs.values()]
    widths = [max([len(h), *(len(line[i]) for line in lines)]) for i, h in enumerate(heads)]
    widths += [max([len(h), *(len(v[i]) for v in values)]) for i, h in enumerate(knob_heads)]
    apart = width is None or sum(w + 2 for w in widths) <= width  # a space either side of each
    words = [[f"{h}={v}" for h, v in zip(knob_heads, value, strict=True) if v != "-"]
             for value in values]  # fmt: skip
    longest = max((len(w) for ws in words for w in ws), default=0)
    # Too narrow for the longest knob word beside the figures: each trial's knobs below them.
    below = (
        not apart
        and width is not None
        and width - sum(w + 2 for w in widths[: len(heads)]) < longest
    )
    table = Table(title=_title(frame, len(lines)), title_justify="left",
                  box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, collapse_padding=True)  # fmt: skip
    for i, head in enumerate(heads):
        numeric = 1 < i < len(heads) - 1  # the figures, between the status and the verdict
        table.add_column(head, no_wrap=True, justify="right" if numeric else "left")
    if apart:
        for head in knob_heads:
            table.add_column(head)
    elif knob_heads and not below:
        table.add_column("knobs that varied", ratio=1, overflow="fold")
    for line, value, said in zip(lines, values, words, strict=True):
        knob_cells = value if apart else [] if below or not knob_heads else [" ".join(said)]
        table.add_row(*line, *knob_cells)
    if not below:
        return table
    knobs_of = [f"{line[0]}  {' '.join(said)}" for line, said in zip(lines, words, strict=True)]
    return Group(table, Text("knobs that varied:", style="dim"), *map(Text, knobs_of))


def _title(frame: pd.DataFrame, shown: int) -> str:
    """Over the table: how many trials ended well (the best is of those), how many ran, and
    how many rows are shown where that is not all: `best of 1 ok (3 trials)`."""
    ok = int((frame[Column.STATUS] == TrialStatus.OK).sum()) if Column.STATUS in frame else 0
    total = len(frame)
    rows = f"; the first {shown:,} shown" if shown < total else ""
    return f"{f'best of {ok:,} ok' if ok else 'none ok'} ({counted(total, 'trial')}{rows})"


def _cells(row: pd.Series, metric: str, remeasured: bool, mfu: str) -> list[str]:
    """A trial's cells before its knobs: id, status, objective, its re-measure, MFU, verdict."""
    value = row.get(metric)
    again = f"{REMEASURED}{metric}"
    failure = row.get(Column.FAILURE_CLASS)
    status = (
        f"{row[Column.STATUS]}: {failure}"
        if row[Column.STATUS] != TrialStatus.OK and not missing(failure) and failure
        else str(row[Column.STATUS])  # ok, or a trial killed or stopped with no failure class
    )
    if not missing(row.get(Column.REUSED_FROM)):
        status += f" (reused #{int(row[Column.REUSED_FROM])})"
    if str(row.get(Column.CORES)) == UNPINNED:
        status += " (unpinned)"
    return [
        str(row[Column.TRIAL_ID]),
        status,
        "-" if missing(value) else f"{value:,.1f}",
        *(_again_cells(value, row[again]) if remeasured else []),
        "-" if missing(row.get(mfu)) else f"{row[mfu]:.3f}",
        _VERDICT.get(row.get(Column.CONVERGENCE_PASSED), "-"),
    ]


def _again_cells(first: Any, second: Any) -> list[str]:
    """A point's second figure and the mean it ranks by ("-" where it was measured once)."""
    if missing(second) or missing(first):
        return ["-" if missing(second) else f"{second:,.1f}", "-"]
    return [f"{second:,.1f}", f"{ranking_of(first, second):,.1f}"]


def dashboard_command(storage: str) -> list[str] | None:
    """The optuna-dashboard installed beside this Python (the project depends on it), by its
    whole path so it runs without the venv on PATH; None where there is none."""
    path = Path(sys.executable).parent / "optuna-dashboard"
    return [str(path), storage] if path.exists() else None


def where(manifest: SweepManifest, sweep_dir: Path) -> list[str]:
    """Lines saying where the sweep's records are and how to open them: the commands as they
    run from the working directory (its sweeps' folder named where it is not `./results`),
    and how to resume it where it did not end well or has records waiting to be written."""
    command = dashboard_command(manifest.optuna_storage)
    dashboard = f" (`{' '.join(command)}`)" if command else ""
    folder = results_dir_of(sweep_dir)
    sweep_id = manifest.sweep_id
    lines = [f"results: {sweep_dir} (summary.csv, best.yaml, report.html)"]
    uri = manifest.tracking_uri
    if uri.startswith(MEMORY_SCHEME):
        lines.append(f"tracking records in this process's memory ({uri}): gone at exit")
    elif served(uri):
        lines.append(f"MLflow: {runs_url(uri, manifest.experiment_id, sweep_id)}")
    else:
        lines.append(
            f"MLflow: `{sweeper_command('ui', sweep_id, results_dir=folder)}` serves {uri} on "
            "127.0.0.1 and prints the sweep's runs page"
        )
    lines.append(f"Optuna study {manifest.study_name!r} in {manifest.optuna_storage}{dashboard}")
    export = sweeper_command("export", sweep_id, "--format", "maxtext", results_dir=folder)
    lines.append(f"export: `{export}` (or env, trial)")
    state = manifest.ending.state
    does = {
        "interrupted": "continues it",
        "running": "continues it if its driver has stopped",
        "finished": "writes the tracking records still waiting",
    }[state]
    if state != "finished" or _records_waiting(sweep_dir):
        again = sweeper_command("resume", sweep_id, results_dir=folder,
                                address=manifest.ray_address or None)  # fmt: skip
        lines.append(f"resume: `{again}` {does}")
    return lines


def _records_waiting(sweep_dir: Path) -> bool:
    """Whether tracking writes wait in the sweep's journal (a resume replays them)."""
    if not (sweep_dir / JOURNAL).exists():
        return False
    try:
        return len(TrackingJournal(sweep_dir / JOURNAL)) > 0
    except ValueError:  # damaged: resume says what to do with it
        return True


def print_sweep(manifest: SweepManifest, frame: pd.DataFrame, sweep_dir: Path) -> None:
    """The sweep as the terminal shows it (its width: COLUMNS, else the terminal's)."""
    for line in sweep_header(manifest, frame):
        console.print(escape(line))
    console.print(sweep_table(manifest, frame, width=console.width))
    for note in manifest.ending.notes:
        say(console, note, "[yellow]note[/yellow] ")
    for line in where(manifest, sweep_dir):
        say(console, line)  # paths, URLs and commands whole, to copy


def sweeps_table(found: list[Found]) -> Table:
    """The sweeps, newest first: id (its start time), space, state, trials, the best."""
    table = Table(title=f"{len(found)} sweep{'s' if len(found) != 1 else ''}", title_justify="left",
                  box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, collapse_padding=True)  # fmt: skip
    table.add_column("sweep (started)", no_wrap=True)
    table.add_column("space")
    table.add_column("state")
    table.add_column("trials", no_wrap=True)
    table.add_column("best trial", no_wrap=True)
    table.add_column("best", justify="right")
    for sweep in found:
        manifest = sweep.manifest
        if manifest is None:
            table.add_row(sweep.sweep_id, sweep.path.parent.name, "damaged", "", "", sweep.problem)
            continue
        ending = manifest.ending
        metric = manifest.space.objective.primary.metric
        best = (
            "-" if ending.best_value is None else f"{ending.best_value:,.1f} {metric_label(metric)}"
        )
        ok, total = ending.counts.get(TrialStatus.OK, 0), ending.counts.get("total", 0)
        table.add_row(
            manifest.sweep_id,
            manifest.space.name,
            ending.state,
            f"{ok}/{total} ok" if total else "-",
            ending.best_trial or "-",
            best,
        )
    return table
