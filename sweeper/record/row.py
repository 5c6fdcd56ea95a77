"""One trial as a row of the sweep's results table (summary.csv, `SweepResult.trials`), typed,
with every column's name declared here once.

A row is made from the trial's final result (`TrialResult`) and what the engine knows of
the trial (its id, Optuna number, MLflow run, attempts, sampled knobs); `to_record()` is its
line of the table, `from_record()` reads one back (a CSV turns numbers into text and gaps
into NaN). Columns a sweep adds after its trials (a ladder's `screen_*`, a re-measurement's
`remeasured_*`) ride along in `extra`.
"""

from __future__ import annotations

import datetime as dt
import json
import math
from collections import Counter
from collections.abc import Iterable, Mapping
from enum import StrEnum
from typing import Any, overload

from pydantic import BaseModel, ConfigDict, Field

from trainer.trial.events import STEP_METRICS as TRAINER_STEP_METRICS
from trainer.trial.events import (
    SUMMARY_NUMBERS,
    FailureClass,
    Fidelity,
    KnobEffect,
    TrialStatus,
)
from trainer.trial.result import TrialResult


class Column(StrEnum):
    """The results table's columns that are not figures or knobs."""

    TRIAL_ID = "trial_id"
    OPTUNA_TRIAL = "optuna_trial"
    MLFLOW_RUN_ID = "mlflow_run_id"
    STATUS = "status"
    FAILURE_CLASS = "failure_class"
    FAILURE_MESSAGE = "failure_message"
    # Out of memory: what the program needs per device, and what the device or the space's
    # budget offered (the compiler's figure, where a compile stated it).
    NEEDED_GIB = "needed_gib"
    BUDGET_GIB = "budget_gib"
    CONVERGENCE_PASSED = "convergence_passed"
    HARDWARE = "hardware"
    PROGRAM = "program"
    FIDELITY = "fidelity"
    HOSTS = "hosts"  # Ray node ids of its processes
    SLICE = "slice"
    PROCESSES = "processes"
    DEVICE_KIND = "device_kind"  # JAX's name for the device
    CORES = "cores"  # cores a local CPU trainer was pinned to
    PIDS = "pids"
    STARTED_AT = "started_at"
    ENDED_AT = "ended_at"
    ATTEMPTS = "attempts"
    REUSED_FROM = "reused_from"
    REMEASURE_OF = "remeasure_of"
    PROGRAM_FINGERPRINT = "program_fingerprint"
    PROFILE_DIR = "profile_dir"
    EFFECTS = "effects"
    TUNED = "tuned"


# kernels.tune's record of a trial: in its folder, and an artifact of its MLflow run.
TUNING_FILE = "tuning.json"
TRAINER_LOG = "trainer.log"  # a local trial's trainer output, in its Tune working directory
LOG_TAIL_LINES = 60  # of it, kept with a failed trial's record

# Columns of the results table that hold a sampled knob: the prefix, then the knob's name.
KNOB_PREFIX = "knob:"
# A re-measured point's second figure, beside its first: `remeasured_<figure>` (the results
# table's column, and the metric on the trial's MLflow run).
REMEASURED = "remeasured_"


@overload
def ranking_of(first: float, again: float | None = None) -> float: ...
@overload
def ranking_of(first: float | None, again: float | None = None) -> float | None: ...
def ranking_of(first: float | None, again: float | None = None) -> float | None:
    """The figure a trial ranks by: its measurement, or, for a point measured again, the mean
    of both (the first was picked for being among the best, so it leans high; the second,
    made to compare, weighs as much). The one rule of every view."""
    if missing(first) or missing(again):
        return first
    assert first is not None and again is not None
    return (first + again) / 2


# A re-measuring sweep's trial runs carry the figure they rank by (the objective; for a point
# measured again, the mean of both) as `ranking_<objective>`: the MLflow view sorts by it.
RANKING = "ranking_"
# Where a trial ran, as MLflow tags too (Ray node ids, slice name, process count, device kind).
LAYOUT_TAGS = (Column.HOSTS, Column.SLICE, Column.PROCESSES, Column.DEVICE_KIND)
# What a running trial reports each step, and what the engine adds to it.
STEP_METRICS = (*TRAINER_STEP_METRICS, "tokens_per_sec_per_chip_running")
# The trainer's summary numbers, and what the engine adds to them.
CONVERGENCE_FIGURES = (
    "convergence_delta",
    "convergence_relative_delta",
    "convergence_tolerance",
    "convergence_seed_noise",
)
FINAL_METRICS = (*SUMMARY_NUMBERS, *CONVERGENCE_FIGURES, "trial_wall_s", "trainer_wall_s")
FAILURE_MESSAGE_CHARS = 300


def knob_column(name: str) -> str:
    return f"{KNOB_PREFIX}{name}"


def knob_columns(columns: Iterable[str]) -> dict[str, str]:
    """column -> knob name, for the results table's knob columns."""
    return {c: c.removeprefix(KNOB_PREFIX) for c in columns if c.startswith(KNOB_PREFIX)}


# Knobs every sweep has, by the name a person calls them.
SHORT_NAMES = {"per_device_batch": "batch", "remat.policy": "remat"}


def short_names(knobs: Iterable[str]) -> dict[str, str]:
    """knob -> the name every view shows it by: without its namespace (mesh.tensor -> tensor,
    remat.custom.context -> custom.context, a few by their usual name: per_device_batch ->
    batch), the whole name where two would read alike."""
    knobs = list(knobs)
    short = {k: SHORT_NAMES.get(k) or k.split(".", 1)[-1] for k in knobs}
    counts = Counter(short.values())
    return {k: k if counts[short[k]] > 1 else short[k] for k in knobs}


def missing(value: Any) -> bool:
    """A results cell with no value: None, or NaN (how a frame holds a missing number)."""
    return value is None or (isinstance(value, float) and math.isnan(value))


def readable(timestamp: float | None) -> str:
    """A Unix time as local ISO 8601 with milliseconds (sortable as text); empty if none."""
    if timestamp is None:
        return ""
    return dt.datetime.fromtimestamp(timestamp).isoformat(timespec="milliseconds")


def final_metrics(result: TrialResult) -> dict[str, float | None]:
    """The numbers a trial ended with: its figures and its convergence verdict's."""
    conv = result.convergence
    return {
        **{k: result.figure(k) for k in FINAL_METRICS if k not in CONVERGENCE_FIGURES},
        "convergence_delta": conv.delta if conv else None,
        "convergence_relative_delta": conv.relative_delta if conv else None,
        "convergence_tolerance": conv.tolerance if conv else None,
        "convergence_seed_noise": conv.seed_noise if conv else None,
    }


def _cell(value: Any) -> Any:
    """A table cell as a value: NaN and empty text are nothing."""
    return None if missing(value) or value == "" else value


def _number(value: Any) -> float | None:
    cell = _cell(value)
    return None if cell is None else float(cell)


def _integer(value: Any) -> int | None:
    number = _number(value)
    return None if number is None else int(number)


def _text(value: Any) -> str:
    cell = _cell(value)
    return "" if cell is None else str(cell)


def _flag(value: Any) -> bool | None:
    cell = _cell(value)
    if cell is None or isinstance(cell, bool):
        return cell
    return str(cell).lower() in ("true", "1", "1.0")


class TrialRow(BaseModel):
    """One trial of a sweep: how it ended, its figures (each at its fidelity), where it ran,
    and the knob values it was sampled with."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    trial_id: str
    status: TrialStatus
    optuna_trial: int | None = None
    mlflow_run_id: str | None = None
    failure_class: FailureClass | None = None
    failure_message: str = ""
    needed_gib: float | None = None
    budget_gib: float | None = None
    figures: dict[str, float | None] = Field(default_factory=dict)
    convergence_passed: bool | None = None
    hardware: str = ""
    program: str = ""
    fidelity: Fidelity | None = None
    hosts: str = ""
    slice: str = ""
    processes: int = 0
    device_kind: str = ""
    cores: str = ""
    pids: str = ""
    started_at: str = ""
    ended_at: str = ""
    attempts: int = 0
    reused_from: int | None = None
    remeasure_of: str = ""
    program_fingerprint: str = ""
    profile_dir: str = ""
    effects: dict[str, KnobEffect] = Field(default_factory=dict)
    tuned: dict[str, int | str] = Field(
        default_factory=dict, description="the kernel tiles kernels.tune chose, as settings"
    )
    knobs: dict[str, Any] = Field(default_factory=dict)
    extra: dict[str, Any] = Field(default_factory=dict)  # columns added after the trials

    @classmethod
    def of(
        cls,
        trial_id: str,
        final: TrialResult,
        knobs: Mapping[str, Any],
        *,
        optuna_trial: int | None = None,
        mlflow_run_id: str | None = None,
        attempts: int = 0,
        remeasure_of: str = "",
    ) -> TrialRow:
        """The row of a trial that ended with `final`."""
        layout = final.layout
        return cls(
            trial_id=trial_id,
            status=final.status,
            optuna_trial=optuna_trial,
            mlflow_run_id=mlflow_run_id,
            failure_class=final.failure_class,
            failure_message=final.failure_message[:FAILURE_MESSAGE_CHARS],
            needed_gib=final.needed_gib,
            budget_gib=final.budget_gib,
            figures=final_metrics(final),
            convergence_passed=final.convergence.passed if final.convergence else None,
            hardware=final.hardware,
            program=final.program,
            fidelity=final.fidelity,
            hosts=layout.hosts,
            slice=layout.slice,
            processes=layout.processes,
            device_kind=layout.device_kind,
            cores=layout.cores,
            pids=layout.pids,
            started_at=readable(layout.started_at),
            ended_at=readable(layout.ended_at),
            attempts=attempts,
            reused_from=final.reused_from,
            remeasure_of=remeasure_of,
            program_fingerprint=final.program_fingerprint,
            profile_dir=final.profile_dir,
            effects=dict(final.effects),
            tuned=dict((final.kernel_tuning or {}).get("settings") or {}),
            knobs=dict(knobs),
        )

    @property
    def ok(self) -> bool:
        return self.status == TrialStatus.OK

    @property
    def is_remeasure(self) -> bool:
        """A second measurement of another trial's point (never a trial of the search)."""
        return bool(self.remeasure_of)

    def figure(self, name: str) -> float | None:
        """A figure of the trial (or a number a later column added), None when it has none."""
        value = self.figures.get(name, self.extra.get(name))
        if missing(value) or not isinstance(value, int | float):
            return None
        return float(value)

    def ranking_figure(self, metric: str) -> float | None:
        """The figure the trial ranks by: its `metric`, or, for a point measured again, the
        mean of its two measurements (sweeper.answer.table.ranking_figure, for a table)."""
        return ranking_of(self.figure(metric), self.figure(f"{REMEASURED}{metric}"))

    def to_record(self) -> dict[str, Any]:
        """The row as the results table holds it: one column per field, figure and knob."""
        record: dict[str, Any] = {
            Column.TRIAL_ID: self.trial_id,
            Column.OPTUNA_TRIAL: self.optuna_trial,
            Column.MLFLOW_RUN_ID: self.mlflow_run_id,
            Column.STATUS: self.status.value,
            Column.FAILURE_CLASS: self.failure_class.value if self.failure_class else "",
            Column.FAILURE_MESSAGE: self.failure_message,
            Column.NEEDED_GIB: self.needed_gib,
            Column.BUDGET_GIB: self.budget_gib,
            **self.figures,
            Column.CONVERGENCE_PASSED: self.convergence_passed,
            Column.HARDWARE: self.hardware,
            Column.PROGRAM: self.program,
            Column.FIDELITY: self.fidelity.value if self.fidelity else "",
            Column.HOSTS: self.hosts,
            Column.SLICE: self.slice,
            Column.PROCESSES: self.processes,
            Column.DEVICE_KIND: self.device_kind,
            Column.CORES: self.cores,
            Column.PIDS: self.pids,
            Column.STARTED_AT: self.started_at,
            Column.ENDED_AT: self.ended_at,
            Column.ATTEMPTS: self.attempts,
            Column.REUSED_FROM: self.reused_from,
            Column.REMEASURE_OF: self.remeasure_of,
            Column.PROGRAM_FINGERPRINT: self.program_fingerprint,
            Column.PROFILE_DIR: self.profile_dir,
            Column.EFFECTS: json.dumps(
                {k: e.model_dump(mode="json") for k, e in self.effects.items()}
            )
            if self.effects
            else "",
            Column.TUNED: json.dumps(self.tuned) if self.tuned else "",
            **{knob_column(k): v for k, v in self.knobs.items()},
        }
        return {str(k): v for k, v in {**record, **self.extra}.items()}

    @classmethod
    def from_record(cls, record: Mapping[str, Any]) -> TrialRow:
        """A row of the results table (a DataFrame's or summary.csv's) as a TrialRow."""
        cells = {str(k): v for k, v in record.items()}
        known = {c.value for c in Column}
        failure = _text(cells.get(Column.FAILURE_CLASS))
        fidelity = _text(cells.get(Column.FIDELITY))
        effects = _text(cells.get(Column.EFFECTS))
        tuned = _text(cells.get(Column.TUNED))
        return cls(
            trial_id=_text(cells[Column.TRIAL_ID]),
            status=TrialStatus(_text(cells[Column.STATUS])),
            optuna_trial=_integer(cells.get(Column.OPTUNA_TRIAL)),
            mlflow_run_id=_cell(cells.get(Column.MLFLOW_RUN_ID)),
            failure_class=FailureClass(failure) if failure else None,
            failure_message=_text(cells.get(Column.FAILURE_MESSAGE)),
            needed_gib=_number(cells.get(Column.NEEDED_GIB)),
            budget_gib=_number(cells.get(Column.BUDGET_GIB)),
            figures={k: _number(cells.get(k)) for k in FINAL_METRICS if k in cells},
            convergence_passed=_flag(cells.get(Column.CONVERGENCE_PASSED)),
            hardware=_text(cells.get(Column.HARDWARE)),
            program=_text(cells.get(Column.PROGRAM)),
            fidelity=Fidelity(fidelity) if fidelity else None,
            hosts=_text(cells.get(Column.HOSTS)),
            slice=_text(cells.get(Column.SLICE)),
            processes=_integer(cells.get(Column.PROCESSES)) or 0,
            device_kind=_text(cells.get(Column.DEVICE_KIND)),
            cores=_text(cells.get(Column.CORES)),
            pids=_text(cells.get(Column.PIDS)),
            started_at=_text(cells.get(Column.STARTED_AT)),
            ended_at=_text(cells.get(Column.ENDED_AT)),
            attempts=_integer(cells.get(Column.ATTEMPTS)) or 0,
            reused_from=_integer(cells.get(Column.REUSED_FROM)),
            remeasure_of=_text(cells.get(Column.REMEASURE_OF)),
            program_fingerprint=_text(cells.get(Column.PROGRAM_FINGERPRINT)),
            profile_dir=_text(cells.get(Column.PROFILE_DIR)),
            effects={k: KnobEffect.model_validate(v) for k, v in json.loads(effects).items()}
            if effects
            else {},
            tuned=json.loads(tuned) if tuned else {},
            knobs={
                name: cells[c]
                for c, name in knob_columns(cells).items()
                if _cell(cells[c]) is not None
            },
            extra={
                k: v
                for k, v in cells.items()
                if k not in known and k not in FINAL_METRICS and not k.startswith(KNOB_PREFIX)
            },
        )
