"""What the CLI prints about sweeps: a sweep's ranked table and notes, where its records are
and how to open them, and the list of sweeps in a results folder."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pandas as pd
from rich.table import Table

from sweeper.answer.notes import UNPINNED
from sweeper.answer.streams import terminal
from sweeper.answer.table import REMEASURED, searched
from sweeper.record.manifest import Found, SweepManifest
from sweeper.record.mlflow_view import runs_url
from sweeper.record.row import Column, knob_columns, missing
from sweeper.record.stores import MEMORY_SCHEME
from trainer.trial.events import TrialStatus

console = terminal()
# A results cell's convergence verdict (a bool, numpy's too, or missing) as shown.
_VERDICT: dict[Any, str] = {True: "passed", False: "failed"}


def served(uri: str) -> bool:
    return uri.startswith(("http://", "https://"))


def sweep_table(manifest: SweepManifest, frame: pd.DataFrame, rows: int = 10) -> Table:
    """The sweep's trials, best first: status, objective, MFU, verdict, knob values."""
    space = manifest.space
    metric = space.objective.primary.metric
    hardware = ", ".join(
        sorted({str(h) for h in frame.get(Column.HARDWARE, []) if not missing(h) and h})
    )
    fidelities = ", ".join(
        sorted({str(f) for f in frame.get(Column.FIDELITY, []) if not missing(f) and f})
    )
    again = f"{REMEASURED}{metric}"  # the best points' second figure, on their first row
    frame = searched(frame)
    counts = manifest.ending.counts or {"total": len(frame)}
    table = Table(
        title=f"sweep {manifest.sweep_id}: {counts}; fidelity {fidelities or '-'} on "
        f"{hardware or '-'}"
    )
    knobs = knob_columns(frame.columns)
    # Compile/estimate trials have no measured MFU: show the roofline bound under its own name.
    mfu = "mfu" if space.effective_fidelity == "run" else "est_mfu"
    remeasured = again in frame
    for col in ("trial", "status", metric, *(["again"] if remeasured else []), mfu,
                "convergence", *knobs.values()):  # fmt: skip
        table.add_column(col)
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


def where(manifest: SweepManifest, sweep_dir: Path) -> list[str]:
    """Lines saying where the sweep's records are and how to open them."""
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
    lines.append(
        f"Optuna study {manifest.study_name!r} in {manifest.optuna_storage} "
        f"(optuna-dashboard {manifest.optuna_storage})"
    )
    lines.append(f"export: `sweeper export {manifest.sweep_id} --format maxtext` (or env, trial)")
    return lines


def print_sweep(manifest: SweepManifest, frame: pd.DataFrame, sweep_dir: Path) -> None:
    terminal(width=max(console.width, 200)).print(sweep_table(manifest, frame))
    for note in manifest.ending.notes:
        console.print(f"[yellow]note[/yellow] {note}", soft_wrap=True)
    for line in where(manifest, sweep_dir):
        console.print(line, soft_wrap=True)  # paths and URLs whole, to copy


def sweeps_table(found: list[Found]) -> Table:
    table = Table(title=f"{len(found)} sweep{'s' if len(found) != 1 else ''}")
    for col in ("sweep", "space", "started", "state", "trials", "best trial", "best"):
        table.add_column(col)
    for sweep in found:
        manifest = sweep.manifest
        if manifest is None:
            table.add_row(
                sweep.sweep_id, sweep.path.parent.name, "", "damaged", "", "", sweep.problem
            )
            continue
        ending = manifest.ending
        metric = manifest.space.objective.primary.metric
        best = "-" if ending.best_value is None else f"{metric} {ending.best_value:,.1f}"
        ok, total = ending.counts.get(TrialStatus.OK, 0), ending.counts.get("total", 0)
        table.add_row(
            manifest.sweep_id,
            manifest.space.name,
            manifest.started_at.replace("T", " "),
            ending.state,
            f"{ok}/{total} ok" if total else "-",
            ending.best_trial or "-",
            best,
        )
    return table
