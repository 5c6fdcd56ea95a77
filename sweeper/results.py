"""A sweep's results table (summary.csv, SweepResult.trials), built from Tune's trials.

Rows come from each trial's final Tune result (or, for a trial cut off, what its ending
says); the tracking adapter only contributes the MLflow run id and the attempt count.
"""

from __future__ import annotations

import datetime as dt
import json
import math
from collections.abc import Callable, Iterable
from typing import Any

from ray.tune.experiment import Trial

from sweeper.search import OPTUNA_NUMBER_KEY, REMEASURE_KEY, knob_point
from trainer.spec.events import STEP_METRICS as TRAINER_STEP_METRICS
from trainer.spec.events import SUMMARY_NUMBERS, FailureClass, TrialStatus
from trainer.spec.result import TrialResult
from trainer.spec.timing import MIN_STEPS_FOR_INTERVAL


def missing(value: Any) -> bool:
    """A results cell with no value: None, or NaN (how a frame holds a missing number)."""
    return value is None or (isinstance(value, float) and math.isnan(value))


STEP_METRICS = (*TRAINER_STEP_METRICS, "tokens_per_sec_per_chip_running")
# The trainer's summary numbers, and what the engine adds to them.
FINAL_METRICS = (
    *SUMMARY_NUMBERS,
    "convergence_delta",
    "convergence_relative_delta",
    "convergence_tolerance",
    "convergence_seed_noise",
    "trial_wall_s",
    "trainer_wall_s",
)
# Where a trial ran (Ray node ids of its processes, slice name, process count, JAX device kind).
LAYOUT_TAGS = ("hosts", "slice", "processes", "device_kind")
# Columns of the results table that hold a sampled knob: the prefix, then the knob's name.
KNOB_PREFIX = "knob:"


def knob_columns(columns: Iterable[str]) -> dict[str, str]:
    """column -> knob name, for the results table's knob columns."""
    return {c: c.removeprefix(KNOB_PREFIX) for c in columns if c.startswith(KNOB_PREFIX)}


def readable(timestamp: float | None) -> str:
    """A Unix time as local ISO 8601 with milliseconds (sortable as text); empty if none."""
    if timestamp is None:
        return ""
    return dt.datetime.fromtimestamp(timestamp).isoformat(timespec="milliseconds")


def final_of(trial: Trial, error: bool, ending: TrialResult | None = None) -> TrialResult:
    """A trial's final result: `ending` (how the sweep ended it), else its final report, else
    what its never making one says: the scheduler stopped it, or its worker failed."""
    if ending is not None:
        return ending
    final = TrialResult.from_report(trial.last_result)
    if final is not None:
        return final
    if error:
        return TrialResult.failed(FailureClass.CRASHED, "the trial's worker failed")
    return TrialResult(status=TrialStatus.STOPPED, failure_message="stopped early by the scheduler")


def final_metrics(result: TrialResult) -> dict[str, float | None]:
    """The numbers a trial ended with: its figures and its convergence verdict's."""
    conv = result.convergence
    return {
        **{k: result.figure(k) for k in FINAL_METRICS if not k.startswith("convergence_")},
        "convergence_delta": conv.delta if conv else None,
        "convergence_relative_delta": conv.relative_delta if conv else None,
        "convergence_tolerance": conv.tolerance if conv else None,
        "convergence_seed_noise": conv.seed_noise if conv else None,
    }


def rows(
    trials: Iterable[Trial],
    finals: dict[str, TrialResult],
    run_id: Callable[[str], str | None],
    attempts: dict[str, int],
) -> list[dict[str, Any]]:
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
        out.append(row(trial, final, run, attempts.get(trial.trial_id, 0)))
    return out


def row(trial: Trial, final: TrialResult, run_id: str | None, attempts: int) -> dict[str, Any]:
    layout = final.layout
    return {
        "trial_id": trial.trial_id,
        "optuna_trial": trial.config.get(OPTUNA_NUMBER_KEY),
        "mlflow_run_id": run_id,
        "status": final.status.value,
        "failure_class": final.failure_class.value if final.failure_class else "",
        "failure_message": final.failure_message[:300],
        # Out of memory: what the program needs per device, and what the device or the
        # space's budget offered (the compiler's figure, where a compile stated it).
        "needed_gib": final.needed_gib,
        "budget_gib": final.budget_gib,
        **final_metrics(final),
        "convergence_passed": final.convergence.passed if final.convergence else None,
        "hardware": final.hardware,
        "program": final.program,
        "fidelity": final.fidelity.value if final.fidelity else "",
        **{k: getattr(layout, k) for k in (*LAYOUT_TAGS, "cores", "pids")},
        "started_at": readable(layout.started_at),
        "ended_at": readable(layout.ended_at),
        "attempts": attempts,
        "reused_from": final.reused_from,
        "remeasure_of": trial.config.get(REMEASURE_KEY, ""),
        "program_fingerprint": final.program_fingerprint,
        "profile_dir": final.profile_dir,
        "effects": json.dumps(final.effects) if final.effects else "",
        **{f"{KNOB_PREFIX}{k}": v for k, v in knob_point(trial.config).items()},
    }


# A trial whose cores other processes used more than this share of the time measured them too.
CONTENDED = 0.10
# The measured figure whose 95% interval a run reports (trainer.spec.timing.step_time_stats).
INTERVAL = {
    "tokens_per_sec_per_chip": ("tokens_per_sec_per_chip_low", "tokens_per_sec_per_chip_high")
}


def searched(frame: Any) -> Any:
    """The rows of the search's own trials: without the re-measurements of its best points
    (they repeat a point; their figure sits beside the first as `remeasured_*`)."""
    if frame.empty or "remeasure_of" not in frame:
        return frame
    return frame[frame["remeasure_of"].fillna("").astype(str) == ""]


REMEASURED = "remeasured_"


def remeasured(frame: Any, metric: str) -> Any:
    """Each point measured again beside its first measurement: `remeasured_<metric>` (and its
    interval) on the first trial's row, read from the re-measuring trial's row."""
    if frame.empty or "remeasure_of" not in frame:
        return frame
    again = frame[frame["remeasure_of"].fillna("").astype(str) != ""]
    if again.empty:
        return frame
    columns = [c for c in (metric, *INTERVAL.get(metric, ())) if c in again]
    second = again.drop_duplicates("remeasure_of", keep="last").set_index("remeasure_of")
    frame = frame.copy()
    for column in columns:
        frame[f"{REMEASURED}{column}"] = frame["trial_id"].map(second[column])
    frame[f"{REMEASURED}by"] = frame["trial_id"].map(second["trial_id"])
    return frame


def _interval(row: Any, metric: str, prefix: str = "") -> str:
    low, high = (f"{prefix}{c}" for c in INTERVAL.get(metric, ("", "")))
    if low not in row or missing(row[low]) or missing(row[high]):
        return ""
    return f" (95% interval {row[low]:,.0f}-{row[high]:,.0f})"


def _overlap(a: Any, b: Any, metric: str, prefix: str = "") -> bool | None:
    low, high = (f"{prefix}{c}" for c in INTERVAL.get(metric, ("", "")))
    cells = [r.get(c) for r in (a, b) for c in (low, high)] if low else []
    if not cells or any(missing(v) for v in cells):
        return None
    return bool(a[low] <= b[high] and b[low] <= a[high])


def noise_notes(frame: Any, metric: str, maximize: bool) -> list[str]:
    """What the run's noise says about the table: whether the best trial is within the noise of
    the next (their 95% intervals overlap), what measuring both again said, and which trials
    shared their cores."""
    notes: list[str] = []
    if frame.empty or "status" not in frame:
        return notes
    mine = searched(frame)
    ok = mine[(mine["status"] == "ok") & mine.get(metric, mine["status"]).notna()]
    ranked = ok.sort_values(metric, ascending=not maximize) if len(ok) >= 2 else None
    if ranked is not None and metric in INTERVAL and set(INTERVAL[metric]) <= set(ok.columns):
        best, second = ranked.iloc[0], ranked.iloc[1]
        overlap = _overlap(best, second, metric)
        if overlap is not None:
            verdict = "within the noise of" if overlap else "ahead of, beyond the noise of,"
            notes.append(
                f"noise: the best trial {best['trial_id']} ({best[metric]:,.0f} {metric}"
                f"{_interval(best, metric)}) is {verdict} the next, {second['trial_id']} "
                f"({second[metric]:,.0f}{_interval(second, metric)})"
                + ("; measure both again (more steps) before choosing" if overlap else "")
            )
    if metric in INTERVAL and "timed_steps" in ok and len(ok) >= 2:
        few = ok[ok["timed_steps"].fillna(0) < MIN_STEPS_FOR_INTERVAL]
        if len(few):
            notes.append(
                f"noise: {len(few)} trial(s) timed fewer than {MIN_STEPS_FOR_INTERVAL} steps "
                f"(trial.steps less measure.skip_steps): no 95% interval, so the table cannot "
                "say whether the winner is within the noise; run more steps"
            )
    if ranked is not None and f"{REMEASURED}{metric}" in ok:
        notes += _remeasure_note(ranked.iloc[0], ranked.iloc[1], metric, maximize)
    if "cpu_contention" in frame:
        busy = frame[frame["cpu_contention"].fillna(0) > CONTENDED]
        if len(busy):
            shares = ", ".join(f"{_named(r)} {r['cpu_contention']:.0%}" for _, r in busy.iterrows())
            notes.append(
                f"contention: other processes used the cores of {len(busy)} trial(s) while they "
                f"were measured ({shares}): their figures measure those processes too"
            )
    return notes


def _named(row: Any) -> str:
    """A trial as the table names it: a re-measurement by the point it measured again."""
    again = row.get("remeasure_of")
    return f"{again} (measured again)" if isinstance(again, str) and again else str(row["trial_id"])


def _remeasure_note(best: Any, second: Any, metric: str, maximize: bool) -> list[str]:
    """Whether the winner's lead over the next survived measuring both again."""
    again = f"{REMEASURED}{metric}"
    if missing(best[again]) or missing(second[again]):
        unmeasured = [str(r["trial_id"]) for r in (best, second) if missing(r[again])]
        return [
            f"re-measured: {', '.join(unmeasured)} has no second figure (its re-measurement "
            "failed or never ran): the lead rests on one measurement"
        ]
    held = (best[again] > second[again]) == maximize or best[again] == second[again]
    overlap = _overlap(best, second, metric, REMEASURED)
    said = (
        "the order held"
        if held
        else f"the order flipped: the second measurement puts {second['trial_id']} ahead"
    )
    noise = (
        ""
        if overlap is None
        else "; their second intervals overlap: within the noise, measure longer before choosing"
        if overlap
        else "; their second intervals do not overlap: the lead is beyond the noise"
    )
    return [
        f"re-measured: the best trial {best['trial_id']} ran {best[metric]:,.0f}, then "
        f"{best[again]:,.0f}{_interval(best, metric, REMEASURED)}; the next, {second['trial_id']}, "
        f"{second[metric]:,.0f}, then {second[again]:,.0f}{_interval(second, metric, REMEASURED)}"
        f" {metric}: {said}{noise}"
    ]
