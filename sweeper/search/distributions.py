"""The space as Optuna sees it: each knob one distribution (the single converter, bounds
inclusive both ways), asked define-by-run so conditional knobs are asked only when active,
and the sampler the space names."""

from __future__ import annotations

import warnings
from typing import Any

import optuna
from optuna.distributions import (
    BaseDistribution,
    CategoricalDistribution,
    FloatDistribution,
    IntDistribution,
)

from sweeper.space.points import OPTUNA_NUMBER_KEY, active
from sweeper.space.schema import Knob, Space


def to_distribution(knob: Knob) -> BaseDistribution:
    """The single converter from a knob to Optuna; int bounds are inclusive on both sides."""
    if knob.values is not None:
        return CategoricalDistribution(knob.values)
    low, high = knob.bounds
    if knob.kind == "int":
        return IntDistribution(int(low), int(high), log=knob.log, step=int(knob.step or 1))
    return FloatDistribution(low, high, log=knob.log, step=knob.step)


def from_distribution(dist: BaseDistribution, when: dict[str, Any] | None = None) -> Knob:
    """Inverse of to_distribution (for round-trip tests and for reading studies back)."""
    when = when or {}
    if isinstance(dist, CategoricalDistribution):
        return Knob(values=list(dist.choices), when=when)
    if isinstance(dist, IntDistribution):
        return Knob(
            low=dist.low,
            high=dist.high,
            step=None if dist.step == 1 else dist.step,
            log=dist.log,
            type="int",
            when=when,
        )
    assert isinstance(dist, FloatDistribution), dist
    return Knob(low=dist.low, high=dist.high, step=dist.step, log=dist.log, type="float", when=when)


def _suggest(trial: Any, name: str, dist: BaseDistribution) -> Any:
    if isinstance(dist, CategoricalDistribution):
        return trial.suggest_categorical(name, dist.choices)
    if isinstance(dist, IntDistribution):
        return trial.suggest_int(name, dist.low, dist.high, step=dist.step, log=dist.log)
    assert isinstance(dist, FloatDistribution), dist
    return trial.suggest_float(name, dist.low, dist.high, step=dist.step, log=dist.log)


class DefineByRun:
    """Optuna define-by-run space: conditional knobs are asked only when active.

    A class, not a closure: Tune checkpoints the searcher with pickle.
    """

    def __init__(self, space: Space):
        self.space = space
        self.dists = {key: to_distribution(knob) for key, knob in space.knobs.items()}

    def __call__(self, trial: Any) -> dict[str, Any]:
        point: dict[str, Any] = {}
        for key, knob in self.space.knobs.items():
            if active(knob, point):
                point[key] = _suggest(trial, key, self.dists[key])
        return {OPTUNA_NUMBER_KEY: trial.number}


def make_sampler(space: Space) -> optuna.samplers.BaseSampler:
    search = space.search
    startup = (
        search.startup_trials
        if search.startup_trials is not None
        else max(1, min(10, search.trials // 3))
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        if search.sampler == "tpe":
            return optuna.samplers.TPESampler(
                seed=search.seed,
                n_startup_trials=startup,
                multivariate=True,
                group=True,
                constant_liar=True,
            )
        if search.sampler == "random":
            return optuna.samplers.RandomSampler(seed=search.seed)
        if search.sampler == "nsga2":
            return optuna.samplers.NSGAIISampler(seed=search.seed)
        if search.sampler == "gp":
            return optuna.samplers.GPSampler(seed=search.seed, n_startup_trials=startup)
        if search.sampler == "cmaes":
            return optuna.samplers.CmaEsSampler(seed=search.seed, n_startup_trials=startup)
        grid = {key: knob.candidates() or [] for key, knob in space.knobs.items()}  # discrete
        return optuna.samplers.GridSampler(grid, seed=search.seed)
