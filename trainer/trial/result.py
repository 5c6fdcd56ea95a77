"""A trial's result as the engine carries it: from the Tune trainable that ran the trial,
through Tune, to the results table, the tracking store, the search and the sweep.

Typed once, beside the events it is read from (trainer/trial/events.py). Ray Tune and Optuna
see plain dicts only at their edge: `to_report` / `from_report` for a Tune result, and
`model_dump` / `model_validate` for what Optuna keeps of it.
"""

from __future__ import annotations

import math
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from trainer.trial.events import ENDED, FailureClass, Fidelity, KnobEffect, TrialStatus

# Keys of a Tune report that the engine reads; the rest is Tune's own bookkeeping.
RESULT_KEY = "sweeper.result"  # the final result, as JSON
STATUS_KEY = "trial_status"  # every report: running, or how the trial ended
PHASE_KEY = "trial_phase"  # a running report: starting, compiling, training, finishing
DONE_KEY = "done"


class Convergence(BaseModel):
    """The loss verdict, as a run trial's summary gives it."""

    model_config = ConfigDict(extra="forbid")
    passed: bool
    delta: float | None = None
    relative_delta: float | None = None
    tolerance: float | None = None
    seed_noise: float | None = None
    reference: str = ""  # where the reference came from: cache, computed, process 0


class Layout(BaseModel):
    """Where and when a trial's processes ran."""

    model_config = ConfigDict(extra="forbid")
    hosts: str = ""  # Ray node ids of its processes
    slice: str = ""
    processes: int = 0
    pids: str = ""
    device_kind: str = ""  # JAX's name for the device
    cores: str = ""  # cores a local CPU trainer was pinned to
    started_at: float | None = None
    ended_at: float | None = None


# Figures of where and when a trial ran: not the measurement, so not copied when a trial
# reuses an earlier result.
RAN_FIGURES = frozenset({"trainer_wall_s", "trial_wall_s", "compile_s"})


class TrialResult(BaseModel):
    """How a trial ended and every figure it produced (each at its fidelity)."""

    model_config = ConfigDict(extra="forbid")
    status: TrialStatus
    failure_class: FailureClass | None = None
    failure_message: str = ""
    failure_field: str | None = Field(default=None, description="the config field at fault")
    failure_step: int | None = None
    needed_gib: float | None = None  # out of memory: what the program needs per device
    budget_gib: float | None = None  # and what it had
    fidelity: Fidelity | None = None
    hardware: str = ""
    backend: str = ""
    program: str = ""  # what ran the trial: sweeper-trainer, or maxtext
    bound: str = ""
    figures: dict[str, float] = Field(
        default_factory=dict, description="every number of the summary, and the engine's timings"
    )
    convergence: Convergence | None = None
    layout: Layout = Layout()
    effects: dict[str, KnobEffect] = Field(
        default_factory=dict, description="knob -> its effect on the backend (status, reason)"
    )
    trial_config: str = ""  # the validated TrialConfig, as JSON
    program_fingerprint: str = ""  # the compiled program's identity (optimized HLO hash)
    profile_dir: str = ""  # a profiler trace's folder, on the host that ran process 0
    kernel_tuning: dict[str, Any] | None = Field(
        default=None, description="kernels.tune's record (the Compiled event's kernel_tuning)"
    )
    log_tail: str = ""
    reused_from: int | None = None  # the Optuna trial whose measurement this reuses
    recovered: bool = False  # recorded before a resumed sweep's driver died

    @classmethod
    def failed(cls, failure_class: FailureClass | str, message: str, **details: Any) -> TrialResult:
        return cls(
            status=TrialStatus.FAILED,
            failure_class=FailureClass(failure_class),
            failure_message=message[:2000],
            **details,
        )

    @property
    def ok(self) -> bool:
        return self.status == TrialStatus.OK

    @property
    def ended(self) -> bool:
        return self.status in ENDED

    def figure(self, name: str) -> float | None:
        value = self.figures.get(name)
        return value if value is not None and math.isfinite(value) else None

    def objective(self, metric: str) -> float:
        """What Tune and Optuna are told: the figure of an ok trial, else NaN."""
        value = self.figure(metric) if self.ok else None
        return math.nan if value is None else value

    def reused(self, from_trial: int) -> TrialResult:
        """This measurement, reported by a later trial of the same point: where and when it
        ran is not that trial's."""
        figures = {k: v for k, v in self.figures.items() if k not in RAN_FIGURES}
        return self.model_copy(
            update={"figures": figures, "layout": Layout(), "reused_from": from_trial}
        )

    def to_report(self, objectives: list[str]) -> dict[str, Any]:
        """The final Tune report: the objectives Tune and its searcher read, the status, and
        the whole result as JSON."""
        return {
            **{m: self.objective(m) for m in objectives},
            STATUS_KEY: self.status.value,
            RESULT_KEY: self.model_dump_json(),
            DONE_KEY: True,
        }

    @classmethod
    def from_report(cls, report: dict[str, Any] | None) -> TrialResult | None:
        """The final result in a Tune report; None for a running report (or none)."""
        text = (report or {}).get(RESULT_KEY)
        return cls.model_validate_json(text) if text else None


def running_report(objectives: list[str], phase: str, **figures: float) -> dict[str, Any]:
    """A Tune report while a trial runs: its phase (and a step's figures), the objectives
    at 0."""
    return {
        **dict.fromkeys(objectives, 0.0),
        **figures,
        STATUS_KEY: TrialStatus.RUNNING.value,
        PHASE_KEY: phase,
    }
