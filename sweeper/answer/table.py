"""A sweep's results table (summary.csv, `SweepResult.trials`): one typed row per trial
(`sweeper.record.row.TrialRow`), made from Tune's trials, as a DataFrame; the search's own
rows apart from re-measurements, and the best trial by the one rule every view uses.

Rows come from each trial's final Tune result (or, for a trial cut off, what its ending
says); the tracking adapter only contributes the MLflow run id and the attempt count.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import pandas as pd

from sweeper.record.callback import final_of
from sweeper.record.manifest import SUMMARY
from sweeper.record.row import REMEASURED, Column, TrialRow, knob_columns, missing, ranking_of
from sweeper.record.trial import SweepTrial
from sweeper.space.points import OPTUNA_NUMBER_KEY, REMEASURE_KEY, knob_point
from sweeper.space.schema import Objective
from trainer.trial.events import TrialStatus
from trainer.trial.result import TrialResult

# The measured figure whose 95% interval a run reports (trainer.trial.timing.step_time_stats).
INTERVAL = {
    "tokens_per_sec_per_chip": ("tokens_per_sec_per_chip_low", "tokens_per_sec_per_chip_high")
}


def row_of(trial: SweepTrial, final: TrialResult, run_id: str | None, attempts: int) -> TrialRow:
    """The row of a Tune trial that ended with `final`."""
    return TrialRow.of(
        trial.trial_id,
        final,
        knob_point(trial.config),
        optuna_trial=trial.config.get(OPTUNA_NUMBER_KEY),
        mlflow_run_id=run_id,
        attempts=attempts,
        remeasure_of=str(trial.config.get(REMEASURE_KEY, "")),
    )


def rows(
    trials: Iterable[SweepTrial],
    finals: dict[str, TrialResult],
    run_id: Callable[[str], str | None],
    attempts: dict[str, int],
) -> list[TrialRow]:
    """One row per trial that started: its final result as recorded when it ended (`finals`)
    or, for a trial a resumed sweep restored as finished, Tune's stored last result."""
    out = []
    for trial in trials:
        final = finals.get(trial.trial_id)
        if final is None and trial.status in ("TERMINATED", "ERROR"):
            final = final_of(trial, trial.status == "ERROR")
        run = run_id(trial.trial_id)
        started = run is not None or TrialResult.from_report(trial.last_result) is not None
        if final is None or not (started or trial.status == "ERROR"):
            continue  # never started (Ctrl-C between trials): resume runs it
        out.append(row_of(trial, final, run, attempts.get(trial.trial_id, 0)))
    return out


def frame_of_rows(trial_rows: Iterable[TrialRow]) -> pd.DataFrame:
    return pd.DataFrame([row.to_record() for row in trial_rows])


def read_frame(sweep_dir: Path) -> pd.DataFrame:
    """A sweep's summary.csv as its results table, knob values as they were sampled (a CSV
    turns them into text); empty when it has none yet."""
    path = sweep_dir / SUMMARY
    if not path.exists() or path.stat().st_size == 0:
        return pd.DataFrame()
    frame = pd.read_csv(path)
    for column in knob_columns(frame.columns):
        frame[column] = frame[column].map(_sampled)
    return frame


def _sampled(value: Any) -> Any:
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError:
            return value
    return value


def searched(frame: pd.DataFrame) -> pd.DataFrame:
    """The rows of the search's own trials: without the re-measurements of its best points
    (they repeat a point; their figure sits beside the first as `remeasured_*`)."""
    if frame.empty or Column.REMEASURE_OF not in frame:
        return frame
    return frame[frame[Column.REMEASURE_OF].fillna("").astype(str) == ""]


def remeasured(frame: pd.DataFrame, metric: str) -> pd.DataFrame:
    """Each point measured again beside its first measurement: `remeasured_<metric>` (and its
    interval) on the first trial's row, read from the re-measuring trial's row."""
    if frame.empty or Column.REMEASURE_OF not in frame:
        return frame
    again = frame[frame[Column.REMEASURE_OF].fillna("").astype(str) != ""]
    if again.empty:
        return frame
    columns = [c for c in (metric, *INTERVAL.get(metric, ())) if c in again]
    second = again.drop_duplicates(Column.REMEASURE_OF, keep="last").set_index(Column.REMEASURE_OF)
    frame = frame.copy()
    for column in columns:
        frame[f"{REMEASURED}{column}"] = frame[Column.TRIAL_ID].map(second[column])
    frame[f"{REMEASURED}by"] = frame[Column.TRIAL_ID].map(second[Column.TRIAL_ID])
    return frame


def constant_knobs(frame: pd.DataFrame) -> dict[str, Any]:
    """knob -> its value, for the knobs that took one value in every trial of `frame` (of two
    or more; a conditional knob inactive in some trials varies)."""
    out = {}
    for column, name in knob_columns(frame.columns).items():
        values = {"-" if missing(v) else str(v) for v in frame[column]}
        if len(values) == 1 and len(frame) > 1:
            out[name] = values.pop()
    return out


def ok_rows(frame: pd.DataFrame) -> pd.DataFrame:
    if frame.empty or Column.STATUS not in frame:
        return frame.iloc[:0]
    return frame[frame[Column.STATUS] == TrialStatus.OK]


def ranking_figure(frame: pd.DataFrame, metric: str) -> pd.Series:
    """The figure each trial ranks by: its objective, or, for a point measured again, the
    mean of its two measurements (the first was picked for being among the best, so it leans
    high; the second, made to compare, weighs as much): TrialRow.ranking_figure, by column."""
    first = pd.to_numeric(frame[metric], errors="coerce")
    again = f"{REMEASURED}{metric}"
    if again not in frame:
        return first
    second = pd.to_numeric(frame[again], errors="coerce")
    return pd.Series(map(ranking_of, first, second), index=frame.index, dtype=float)


def in_rank_order(frame: pd.DataFrame, objective: Objective) -> pd.DataFrame:
    """`frame` best first by `ranking_figure` (rows without the figure last, ties as found)."""
    if frame.empty or objective.metric not in frame:
        return frame
    key = ranking_figure(frame, objective.metric)
    order = key.sort_values(
        ascending=objective.mode == "min", na_position="last", kind="stable"
    ).index
    return frame.loc[order]


def ranked(frame: pd.DataFrame, objective: Objective) -> pd.DataFrame:
    """The search's trials that ended well, best first by the objective (a re-measurement
    repeats a point: its first trial ranks, by the mean of both measurements)."""
    if f"{REMEASURED}{objective.metric}" not in frame:
        frame = remeasured(frame, objective.metric)
    ok = ok_rows(searched(frame))
    if ok.empty or objective.metric not in ok:
        return ok.iloc[:0]
    return in_rank_order(ok[ok[objective.metric].notna()], objective)


def best_row(frame: pd.DataFrame, objective: Objective) -> TrialRow | None:
    """The sweep's best trial: the rule the final table, best.yaml, export, the sweep's MLflow
    run and the progress line all use."""
    best = ranked(frame, objective)
    if best.empty:
        return None
    return TrialRow.from_record(cells(best.iloc[0]))


def cells(row: pd.Series) -> dict[str, Any]:
    """A frame row as column -> cell."""
    return {str(k): v for k, v in row.to_dict().items()}
