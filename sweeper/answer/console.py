"""What the CLI prints about sweeps: a sweep's ranked table and notes, where its records are
and how to open them, and the list of sweeps in a results folder."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pandas as pd
from rich.table import Table

from sweeper.answer.notes import UNPINNED
from sweeper.answer.streams import terminal
from sweeper.answer.table import constant_knobs, searched
from sweeper.record.manifest import Found, SweepManifest
from sweeper.record.mlflow_view import runs_url
from sweeper.record.row import REMEASURED, Column, knob_columns, missing, short_names
from sweeper.record.stores import MEMORY_SCHEME
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
    counts = manifest.ending.counts or {"total": len(searched(frame))}
    told = ", ".join(f"{n} {k}" for k, n in counts.items())
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


def sweep_table(manifest: SweepManifest, frame: pd.DataFrame, rows: int = 10) -> Table:
    """The sweep's trials, best first: id, status, objective (and its re-measure), MFU,
    convergence verdict and the values of the knobs that varied, by their short names."""
    space = manifest.space
    metric = space.objective.primary.metric
    again = f"{REMEASURED}{metric}"  # the best points' second figure, on their first row
    frame = searched(frame)
    same = constant_knobs(frame)
    knobs = {c: n for c, n in knob_columns(frame.columns).items() if n not in same}
    names = short_names(knobs.values())
    table = Table(title=f"best {min(rows, len(frame))} of {len(frame)}", title_justify="left")
    # Compile/estimate trials have no measured MFU: show the roofline bound under its own name.
    mfu = "mfu" if space.effective_fidelity == "run" else "est_mfu"
    remeasured = again in frame
    table.add_column("trial", no_wrap=True)
    table.add_column("status")
    table.add_column(metric_label(metric), justify="right")
    if remeasured:
        table.add_column("again", justify="right")
    table.add_column(mfu, justify="right")
    table.add_column("conv.")
    for name in knobs.values():
        table.add_column(names[name])
    if frame.empty:
        return table
    ordered = frame.sort_values(
        metric, ascending=space.objective.primary.mode == "min", na_position="last"
    )
    for _, row in ordered.head(rows).iterrows():
        value = row.get(metric)
        status = (
            row[Column.STATUS]
            if row[Column.STATUS] == TrialStatus.OK
            else f"{row[Column.STATUS]}: {row[Column.FAILURE_CLASS]}"
        )
        if not missing(row.get(Column.REUSED_FROM)):
            status += f" (reused #{int(row[Column.REUSED_FROM])})"
        if str(row.get(Column.CORES)) == UNPINNED:
            status += " (unpinned)"
        table.add_row(
            str(row[Column.TRIAL_ID]),
            status,
            "-" if missing(value) else f"{value:,.1f}",
            *([("-" if missing(row[again]) else f"{row[again]:,.1f}")] if remeasured else []),
            "-" if missing(row.get(mfu)) else f"{row[mfu]:.3f}",
            _VERDICT.get(row.get(Column.CONVERGENCE_PASSED), "-"),
            *["-" if missing(row[c]) else str(row[c]) for c in knobs],
        )
    return table


def dashboard_command(storage: str) -> list[str] | None:
    """The optuna-dashboard installed beside this Python (the project depends on it), by its
    whole path so it runs without the venv on PATH; None where there is none."""
    path = Path(sys.executable).parent / "optuna-dashboard"
    return [str(path), storage] if path.exists() else None


def where(manifest: SweepManifest, sweep_dir: Path) -> list[str]:
    """Lines saying where the sweep's records are and how to open them."""
    command = dashboard_command(manifest.optuna_storage)
    dashboard = f" (`{' '.join(command)}`)" if command else ""
    lines = [f"results: {sweep_dir} (summary.csv, best.yaml, report.html)"]
    uri = manifest.tracking_uri
    if uri.startswith(MEMORY_SCHEME):
        lines.append(f"tracking records in this process's memory ({uri}): gone at exit")
    elif served(uri):
        lines.append(f"MLflow: {runs_url(uri, manifest.experiment_id, manifest.sweep_id)}")
    else:
        lines.append(
            f"MLflow: `sweeper ui {manifest.sweep_id}` serves {uri} on 127.0.0.1 and prints "
            "the sweep's runs page"
        )
    lines.append(f"Optuna study {manifest.study_name!r} in {manifest.optuna_storage}{dashboard}")
    lines.append(f"export: `sweeper export {manifest.sweep_id} --format maxtext` (or env, trial)")
    return lines


def print_sweep(manifest: SweepManifest, frame: pd.DataFrame, sweep_dir: Path) -> None:
    """The sweep as the terminal shows it (its width: COLUMNS, else the terminal's)."""
    for line in sweep_header(manifest, frame):
        console.print(line)
    console.print(sweep_table(manifest, frame))
    for note in manifest.ending.notes:
        console.print(f"[yellow]note[/yellow] {note}", soft_wrap=True)
    for line in where(manifest, sweep_dir):
        console.print(line, soft_wrap=True)  # paths and URLs whole, to copy


def sweeps_table(found: list[Found]) -> Table:
    """The sweeps, newest first: id (its start time), space, state, trials, the best."""
    table = Table(title=f"{len(found)} sweep{'s' if len(found) != 1 else ''}", title_justify="left")
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
