"""How a trial's ending reaches Optuna: what it was (ok, infeasible, failed, pruned), the
constraints a constraint-aware sampler learns from, the result kept with its Optuna trial,
and the study a sweep continues or closes."""

from __future__ import annotations

import math
from enum import StrEnum
from typing import Any

import optuna
from optuna.distributions import BaseDistribution
from optuna.trial import TrialState
from pydantic import ValidationError

from sweeper.search.distributions import to_distribution
from sweeper.space.schema import Space
from trainer.trial.events import FailureClass, TrialStatus
from trainer.trial.result import TrialResult


class Outcome(StrEnum):
    """What a trial's ending tells Optuna."""

    OK = "ok"  # COMPLETE, constraints met
    INFEASIBLE = "infeasible"  # COMPLETE, constraints violated: a region to avoid
    FAILED = "failed"  # FAIL: crashed, timed out, the compiler failed
    PRUNED = "pruned"  # PRUNED: stopped early by the scheduler


def durable_result(result: TrialResult) -> dict[str, Any]:
    """What of a trial's final result is stored with its Optuna trial: all but its bulky
    text, as JSON (a figure that is not finite is left out)."""
    figures = {k: v for k, v in result.figures.items() if math.isfinite(v)}
    kept = result.model_copy(update={"figures": figures, "log_tail": "", "trial_config": ""})
    return kept.model_dump(mode="json", exclude_defaults=True)


# A failure that is a property of the point: the search must learn to avoid the region.
INFEASIBLE_CLASSES = frozenset(
    {
        FailureClass.INVALID_CONFIG,
        FailureClass.OOM_HBM,
        FailureClass.OOM_VMEM,
        FailureClass.DIVERGED,
    }
)


def stored_result(trial: optuna.trial.FrozenTrial) -> TrialResult | None:
    """The result an Optuna trial keeps (`durable_result`); None without one, or with one
    this version cannot read (a study continued from an older sweeper)."""
    try:
        return TrialResult.model_validate(trial.user_attrs["result"])
    except (KeyError, ValidationError):
        return None


def outcome(final: TrialResult | None, error: bool, reported: bool = True) -> Outcome:
    """What a trial's final result tells Optuna (None: it never made one; `reported`: Tune
    saw a report of it running)."""
    if final is not None and final.status == TrialStatus.OK:
        return Outcome.OK
    if final is not None and final.status == TrialStatus.FAILED:
        return Outcome.INFEASIBLE if final.failure_class in INFEASIBLE_CLASSES else Outcome.FAILED
    return Outcome.FAILED if error or not reported else Outcome.PRUNED


CONSTRAINTS = ("validity", "memory", "convergence")


def constraint_vector(final: TrialResult | None) -> list[float]:
    """Values for CONSTRAINTS; each <= 0 when satisfied (Optuna's convention)."""
    if final is None:
        return [0.0, 0.0, 0.0]
    failure = final.failure_class
    validity = 1.0 if failure == FailureClass.INVALID_CONFIG else 0.0
    memory = 1.0 if failure in (FailureClass.OOM_HBM, FailureClass.OOM_VMEM) else 0.0
    if final.needed_gib and final.budget_gib:
        memory = final.needed_gib / final.budget_gib - 1.0
    convergence = 0.0
    conv = final.convergence
    delta, tol = (conv.relative_delta, conv.tolerance) if conv else (None, None)
    if delta is not None and tol is not None and math.isfinite(delta):
        convergence = abs(delta) - tol
    elif failure == FailureClass.DIVERGED:
        convergence = 1.0
    return [validity, memory, convergence]


def close_open_trials(study: optuna.Study, sweep_id: str, own_study: bool) -> int:
    """FAIL the sweep's Optuna trials still RUNNING once its Tune experiment has ended.

    A driver killed between Optuna's ask and Tune's checkpoint leaves such trials; so does
    one killed before it could tell. In a study shared across sweeps (`--study`), only this
    sweep's trials are closed.
    """
    closed = 0
    for trial in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        owner = trial.user_attrs.get("sweep_id", sweep_id if own_study else None)
        if owner == sweep_id:
            study.tell(trial.number, None, state=TrialState.FAIL)
            closed += 1
    return closed


def check_study(space: Space, study_name: str, storage: str) -> None:
    """A study continued across sweeps must ask the same questions: same directions, and each
    knob it already knows with a compatible distribution. Raises ValueError naming the fix."""
    try:
        study = optuna.load_study(study_name=study_name, storage=storage)
    except KeyError:
        return  # a new study
    modes = ["maximize" if o.mode == "max" else "minimize" for o in space.objective.all]
    if [d.name.lower() for d in study.directions] != modes:
        raise ValueError(
            f"study {study_name!r} optimizes {[d.name.lower() for d in study.directions]}, this "
            f"space {modes}; use another --study name"
        )
    known: dict[str, BaseDistribution] = {}
    for trial in study.get_trials(deepcopy=False):
        known.update(trial.distributions)
    for key, knob in space.knobs.items():
        if key in known:
            try:
                optuna.distributions.check_distribution_compatibility(
                    known[key], to_distribution(knob)
                )
            except ValueError as exc:
                raise ValueError(
                    f"knobs.{key}: study {study_name!r} knows it as {known[key]}, which {exc}; "
                    "keep the knob's values or use another --study name"
                ) from None
