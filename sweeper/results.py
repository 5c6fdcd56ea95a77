"""A sweep's results table (summary.csv, SweepResult.trials), built from Tune's trials.

Rows come from each trial's final Tune result (or, for a trial cut off, what its ending
says); the tracking adapter only contributes the MLflow run id and the attempt count.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

from sweeper.search import OPTUNA_NUMBER_KEY, knob_point
from trainer.spec.events import ENDED, SUMMARY_NUMBERS, FailureClass, TrialStatus
from trainer.spec.events import STEP_METRICS as TRAINER_STEP_METRICS


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


def final_of(trial, error: bool, ending: dict[str, Any] | None = None) -> dict[str, Any]:
    """A trial's final result: its last report, or what its ending says when it never made one."""
    final = {**(trial.last_result or {}), **(ending or {})}
    if final.get("trial_status") not in ENDED:
        # The trainable never made its final report: stopped by the scheduler, or the worker died.
        final = {**final, "trial_status": TrialStatus.FAILED if error else TrialStatus.STOPPED}
        final["failure_class"] = FailureClass.CRASHED if error else ""
        final["failure_message"] = (
            "the trial's worker failed" if error else "stopped early by the scheduler"
        )
    return final


def rows(
    trials: Iterable,
    finals: dict[str, dict[str, Any]],
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
        if final is None or (run is None and not trial.last_result):
            continue
        out.append(row(trial, final, run, attempts.get(trial.trial_id, 0)))
    return out


def row(trial, final: dict[str, Any], run_id: str | None, attempts: int) -> dict[str, Any]:
    return {
        "trial_id": trial.trial_id,
        "optuna_trial": trial.config.get(OPTUNA_NUMBER_KEY),
        "mlflow_run_id": run_id,
        "status": final.get("trial_status"),
        "failure_class": final.get("failure_class") or "",
        "failure_message": (final.get("failure_message") or "")[:300],
        **{k: final.get(k) for k in FINAL_METRICS},
        "convergence_passed": final.get("convergence_passed"),
        "hardware": final.get("hardware", ""),
        "fidelity": final.get("fidelity", ""),
        **{k: final.get(k) for k in (*LAYOUT_TAGS, "cores", "pids", "started_at", "ended_at")},
        "attempts": attempts,
        "reused_from": final.get("reused_from"),
        "effects": final.get("effects", ""),
        **{f"knob:{k}": v for k, v in knob_point(trial.config).items()},
    }
