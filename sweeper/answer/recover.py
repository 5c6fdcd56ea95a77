"""A sweep's results table whatever became of its files: summary.csv as written, or, when it
is missing or damaged, rebuilt from the sweep's runs in its tracking store (MLflow keeps every
trial's status, figures, knobs and where it ran); and its Optuna study, or why it is gone.
What was rebuilt is said; what cannot be is refused by name (the file, and the fix)."""

from __future__ import annotations

import contextlib
from typing import Any

import pandas as pd

from sweeper.answer.table import frame_of_rows, read_frame, remeasured
from sweeper.record.manifest import SUMMARY, Found
from sweeper.record.mlflow_view import KNOB_PARAM, TUNED_PARAM
from sweeper.record.row import FINAL_METRICS, LAYOUT_TAGS, REMEASURED, Column, TrialRow
from sweeper.record.stores import RunRecord, store_for
from sweeper.record.tracker import bound_mlflow_requests
from sweeper.space.errors import SpaceError
from trainer.trial.events import FailureClass, Fidelity, TrialStatus
from trainer.trial.result import TrialResult


def sweep_frame(found: Found) -> tuple[pd.DataFrame, list[str]]:
    """The sweep's table and what was done to have it: its summary.csv, else rebuilt from its
    runs in the tracking store. SpaceError naming summary.csv when neither can be read and the
    sweep had trials."""
    manifest = found.manifest
    assert manifest is not None, "a sweep found by id has a manifest"
    path = found.path / SUMMARY
    try:
        frame = read_frame(found.path)
    except (OSError, ValueError, pd.errors.ParserError) as exc:
        why = f"damaged ({type(exc).__name__}: {str(exc)[:120]})"
    else:
        if not frame.empty and {Column.TRIAL_ID, Column.STATUS} <= set(frame.columns):
            return frame, []
        if not path.exists():
            why = "missing"
        else:
            why = "empty" if frame.empty else "damaged (no trial_id and status columns)"
    runs, problem = _runs_of(found)
    if runs:
        note = (f"{SUMMARY} was {why}: the table is rebuilt from the sweep's {len(runs)} runs "
                f"in {manifest.tracking_uri} (figures, knobs and statuses as MLflow keeps them)")  # fmt: skip
        metric = manifest.space.objective.primary.metric
        frame = remeasured(frame_of_rows(_row(run) for run in runs), metric)
        return _with_remeasures(frame, runs), [note]
    if not manifest.ending.counts.get("total"):
        return pd.DataFrame(), [f"no trial of this sweep has ended yet ({SUMMARY} {why})"]
    raise SpaceError(
        f"{SUMMARY} is {why} and the sweep's runs cannot be read back ({problem}); "
        "put the file back, or reach the tracking store it was recorded in "
        f"({manifest.tracking_uri})",
        file=str(path),
    )


def _runs_of(found: Found) -> tuple[list[RunRecord], str]:
    """The sweep's trial runs as its tracking store keeps them, or none and why."""
    manifest = found.manifest
    assert manifest is not None
    bound_mlflow_requests()  # bounded calls, no progress bars
    try:
        store = store_for(manifest.tracking_uri)
        ids = store.search(
            manifest.experiment_id,
            {"sweeper.sweep_id": manifest.sweep_id, "sweeper.kind": "trial"},
        )
        return [store.read(run_id) for run_id in ids], ""
    except Exception as exc:  # a store gone, a run unreadable: said, not raised
        return [], f"{type(exc).__name__}: {str(exc)[:160]}"


def _with_remeasures(frame: pd.DataFrame, runs: list[RunRecord]) -> pd.DataFrame:
    """The second measurements a trial's run carries (`remeasured_<figure>`, `remeasured_by`)
    as the columns summary.csv has them."""
    again = {
        run.tags.get("sweeper.trial_id", run.run_id): {
            **{k: v for k, v in run.metrics.items() if k.startswith(REMEASURED)},
            f"{REMEASURED}by": run.tags.get(f"{REMEASURED}by"),
        }
        for run in runs
        if f"{REMEASURED}by" in run.tags
    }
    if not again:
        return frame
    columns = sorted({c for figures in again.values() for c in figures})
    frame = frame.copy()
    for column in columns:
        frame[column] = frame[Column.TRIAL_ID].map(lambda t, c=column: again.get(t, {}).get(c))
    return frame


def _row(run: RunRecord) -> TrialRow:
    """A trial's row as its MLflow run keeps it (no program fingerprint, no effects)."""
    tags = run.tags
    status = tags.get("status", "")
    failure = tags.get("failure_class", "")
    fidelity = tags.get("fidelity", "")
    reused = tags.get("reused_from", "").removeprefix("optuna trial ")
    layout: dict[str, Any] = {str(k): tags.get(k, "") for k in LAYOUT_TAGS}
    with contextlib.suppress(ValueError):
        layout[Column.PROCESSES] = int(layout[Column.PROCESSES] or 0)
    return TrialRow(
        trial_id=tags.get("sweeper.trial_id", run.run_id),
        status=TrialStatus(status) if status in tuple(TrialStatus) else TrialStatus.KILLED,
        optuna_trial=int(tags["sweeper.optuna_trial"])
        if tags.get("sweeper.optuna_trial", "").isdigit()
        else None,
        mlflow_run_id=run.run_id,
        failure_class=FailureClass(failure) if failure in tuple(FailureClass) else None,
        figures={k: run.metrics[k] for k in FINAL_METRICS if k in run.metrics},
        convergence_passed={"passed": True, "failed": False}.get(tags.get("convergence", "")),
        hardware=tags.get("hardware", ""),
        program=tags.get("program", ""),
        fidelity=Fidelity(fidelity) if fidelity in tuple(Fidelity) else None,
        started_at=tags.get("started_at", ""),
        ended_at=tags.get("ended_at", ""),
        attempts=int(tags["attempts"]) if tags.get("attempts", "").isdigit() else 1,
        reused_from=int(reused) if reused.isdigit() else None,
        remeasure_of=tags.get("sweeper.remeasure_of", ""),
        knobs={
            k.removeprefix(KNOB_PARAM): v for k, v in run.params.items() if k.startswith(KNOB_PARAM)
        },
        tuned={
            k.removeprefix(TUNED_PARAM): int(v) if v.isdigit() else v
            for k, v in run.params.items()
            if k.startswith(TUNED_PARAM)
        },
        **layout,
    )


def study_of(found: Found) -> tuple[Any | None, list[str]]:
    """The sweep's Optuna study, or None and why (a study file deleted or replaced)."""
    import optuna

    manifest = found.manifest
    assert manifest is not None
    try:
        return optuna.load_study(
            study_name=manifest.study_name, storage=manifest.optuna_storage
        ), []
    except Exception as exc:  # KeyError: no such study; a file that is not a study
        return None, [
            f"knob importances left out: the Optuna study {manifest.study_name!r} is not in "
            f"{manifest.optuna_storage} ({type(exc).__name__}: {str(exc)[:120]})"
        ]


def result_of_run(run: RunRecord) -> TrialResult | None:
    """The result a trial's terminated MLflow run records (its status, failure, figures and
    where its figures are from); None for a run that never recorded an ending."""
    tags = run.tags
    status, failure = tags.get("status", ""), tags.get("failure_class", "")
    if run.status not in ("FINISHED", "FAILED") or status not in (
        TrialStatus.OK,
        TrialStatus.FAILED,
    ):
        return None
    fidelity = tags.get("fidelity", "")
    tail = run.texts.get("trainer_log_tail.txt", "")
    message = tail.split("\n\n", 1)[0].removeprefix(f"{failure}: ") if tail else ""
    return TrialResult(
        status=TrialStatus(status),
        failure_class=FailureClass(failure) if failure in tuple(FailureClass) else None,
        failure_message=message or ("recorded by MLflow" if failure else ""),
        fidelity=Fidelity(fidelity) if fidelity in tuple(Fidelity) else None,
        hardware=tags.get("hardware", ""),
        backend=tags.get("backend", ""),
        program=tags.get("program", ""),
        bound=tags.get("bound", ""),
        figures={k: v for k, v in run.metrics.items() if k not in ("convergence_passed",)},
        trial_config=run.texts.get("trial.json", ""),
        recovered=True,
    )
