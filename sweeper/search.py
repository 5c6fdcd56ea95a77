"""The space as an Optuna define-by-run search, samplers, and how trial endings reach Optuna."""

from __future__ import annotations

import hashlib
import json
import math
import pickle
import warnings
from typing import Any

import optuna
from optuna.distributions import (
    BaseDistribution,
    CategoricalDistribution,
    FloatDistribution,
    IntDistribution,
)
from optuna.trial import TrialState
from pydantic import ValidationError
from ray.tune.search import Searcher

from sweeper.space import Knob, Space, active, assemble, maxtext_knobs
from trainer.spec.events import FailureClass, TrialStatus
from trainer.spec.result import STATUS_KEY, TrialResult

OPTUNA_NUMBER_KEY = "sweeper.optuna_trial"
# Asks in a row that may draw points this sweep has before it is taken to have them all.
MAX_REPEATS = 50
# A point measured before in this study: its stored result, reused instead of run again.
REUSE_KEY = "sweeper.reuse"
# A trial that measures again the point of an ended trial of this sweep (its Tune id).
REMEASURE_KEY = "sweeper.remeasure_of"
# Config keys that steer a trial and are not knobs.
CONTROL_PREFIX = "sweeper."


def knob_point(config: dict[str, Any]) -> dict[str, Any]:
    """The sampled knob values of a Tune trial config (without the engine's control keys)."""
    return {k: v for k, v in config.items() if not k.startswith(CONTROL_PREFIX)}


def point_key(space: Space, point: dict[str, Any]) -> str:
    """Identity of a measurement: the whole trial configuration, fidelity and target, and for
    MaxText the program and its `maxtext.*` settings (not part of the trial configuration:
    without them, points that differ only in a MaxText setting were one point, and the
    sweep skipped all but the first as a repeat). Our trainer's keys are as they were."""
    what = {"trial": assemble(space, point), "fidelity": space.effective_fidelity,
            "target": space.target}  # fmt: skip
    if space.program != "sweeper-trainer":
        what.update(program=space.program, settings=maxtext_knobs(point))
    return hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()[:20]


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


def check_sampler(space: Space) -> None:
    """Raise ValueError naming the fix when the chosen sampler cannot serve this space."""
    sampler = space.search.sampler
    if sampler == "grid":
        conditional = [k for k, knob in space.knobs.items() if knob.when]
        continuous = [k for k, knob in space.knobs.items() if knob.candidates() is None]
        if conditional or continuous:
            raise ValueError(
                f"search.sampler: grid needs unconditional discrete knobs; conditional: {conditional}, "
                f"continuous: {continuous}. Use tpe or random."
            )
    needs = {"gp": ("torch", "pip install torch"), "cmaes": ("cmaes", "pip install cmaes")}
    if sampler in needs:
        module, fix = needs[sampler]
        try:
            __import__(module)
        except ImportError:
            raise ValueError(
                f"search.sampler: {sampler} needs the {module!r} package ({fix}), or use tpe"
            ) from None
    if sampler == "nsga2" and space.objective.secondary is None:
        raise ValueError(
            "search.sampler: nsga2 is multi-objective; add objective.secondary or use tpe"
        )


def stored_result(trial: optuna.trial.FrozenTrial) -> TrialResult | None:
    """The result an Optuna trial keeps (`durable_result`); None without one, or with one
    this version cannot read (a study continued from an older sweeper)."""
    try:
        return TrialResult.model_validate(trial.user_attrs["result"])
    except (KeyError, ValidationError):
        return None


def outcome(final: TrialResult | None, error: bool, reported: bool = True) -> str:
    """ok | infeasible | failed | pruned, from a trial's final result (None: it never made
    one; `reported`: Tune saw a report of it running)."""
    if final is not None and final.status == TrialStatus.OK:
        return "ok"
    if final is not None and final.status == TrialStatus.FAILED:
        return "infeasible" if final.failure_class in INFEASIBLE_CLASSES else "failed"
    return "failed" if error or not reported else "pruned"


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


class SweepSearch(Searcher):
    """Ray Tune's documented Searcher interface on Optuna's ask/tell.

    Each Tune trial asks the study for a point (define-by-run: conditional knobs are asked
    only when active) and tells it what really happened: ok -> COMPLETE with feasible
    constraints; an infeasible point (invalid, OOM, diverged) -> COMPLETE with violated
    constraints, so constraint-aware samplers learn the region; crashed/timeout/compile
    error -> FAIL; stopped early -> PRUNED. A running trial's throughput is reported as an
    intermediate value, never told as a result.
    """

    def __init__(
        self,
        space: Space,
        *,
        sweep_id: str = "",
        metric: str | list[str],
        mode: str | list[str],
        sampler: optuna.samplers.BaseSampler,
        study_name: str,
        storage: optuna.storages.BaseStorage | str,
        points_to_evaluate: list[dict[str, Any]] | None = None,
        remeasure: int = 0,
    ):
        # Lists for a multi-objective study: Ray's Searcher takes them (its hint says str).
        super().__init__(metric=metric, mode=mode)  # type: ignore[arg-type]
        self._sweep_space = space
        self._sweep_id = sweep_id
        self._define = DefineByRun(space)
        modes = mode if isinstance(mode, list) else [mode]
        self._ot_study = optuna.create_study(
            storage=storage,
            sampler=sampler,
            pruner=optuna.pruners.NopPruner(),
            study_name=study_name,
            load_if_exists=True,
            directions=["minimize" if m == "min" else "maximize" for m in modes],
        )
        with warnings.catch_warnings():  # set_metric_names is experimental in Optuna 5
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            self._ot_study.set_metric_names(space.objective.metrics)  # dashboards name them
        for point in points_to_evaluate or []:
            self._ot_study.enqueue_trial(point)
        self._ot_trials: dict[str, optuna.Trial] = {}  # Tune trial id -> its Optuna trial
        self._completed_trials: set[str] = set()
        self._points: dict[str, str] = {}  # point key -> the Tune trial of this sweep that runs it
        self.exhausted = False  # asks kept drawing points this sweep has
        self._closing = False  # the sweep was interrupted: fail_unfinished told the rest
        self._reruns: set[str] = set()  # trials rerun after fail_unfinished told them FAIL
        self._remeasure = remeasure  # best points measured again once the search has ended
        self._configs: dict[str, dict[str, Any]] = {}  # Tune trial id -> the config it ran
        self._values: dict[str, float] = {}  # ok trials of the search -> primary objective
        self._remeasures: dict[str, str] = {}  # re-measuring Tune trial -> the trial it repeats

    def suggest(self, trial_id: str) -> dict[str, Any] | str | None:  # type: ignore[override]
        """The point trial `trial_id` runs. A point this sweep has already run (or is
        running) is not run again: the sampler is told its result (or, still running, that
        this ask failed) and asked anew, so `search.trials` counts distinct points. A point
        an earlier sweep of the study measured is reused (`REUSE_KEY`): it counts. When asks
        keep drawing points this sweep has, it has them all: Searcher.FINISHED (Ray's
        documented end of a search; its type hint leaves that string out)."""
        if trial_id in self._remeasures:  # asked again (a restored sweep)
            return self._remeasure_config(self._remeasures[trial_id])
        if trial_id in self._ot_trials:  # asked again for a trial it has (a restored sweep)
            return self._config(trial_id, self._ot_trials[trial_id])
        if self.exhausted or len(self._ot_trials) >= self._sweep_space.search.trials:
            return self._next_remeasure(trial_id)
        for _ in range(MAX_REPEATS):
            ot_trial = self._ot_study.ask()
            ot_trial.set_user_attr("sweep_id", self._sweep_id)
            key = point_key(self._sweep_space, self._point(ot_trial))
            ot_trial.set_user_attr("point_key", key)
            if key in self._points:
                self._tell_repeat(ot_trial, key)
                continue
            self._points[key] = trial_id
            self._ot_trials[trial_id] = ot_trial
            return self._config(trial_id, ot_trial)
        self.exhausted = True  # every recent ask was a point this sweep has: it has them all
        return self._next_remeasure(trial_id)

    def _next_remeasure(self, trial_id: str) -> dict[str, Any] | str | None:
        """Once every trial of the search has ended, the best ok points not yet measured
        again, one per Tune trial (`REMEASURE_KEY`: no Optuna trial, nothing told); None
        while search trials still run (Tune asks again); FINISHED when there are no more."""
        if len(self._remeasures) >= self._remeasure:
            return Searcher.FINISHED
        if any(t not in self._completed_trials for t in self._ot_trials):
            return None
        again = set(self._remeasures.values())
        left = [t for t in self._values if t not in again]
        if not left:
            return Searcher.FINISHED
        maximize = self._sweep_space.objective.primary.mode == "max"
        best = (max if maximize else min)(left, key=lambda t: self._values[t])
        self._remeasures[trial_id] = best
        return self._remeasure_config(best)

    def _remeasure_config(self, original: str) -> dict[str, Any]:
        return {**knob_point(self._configs[original]), REMEASURE_KEY: original}

    def _point(self, ot_trial: optuna.Trial) -> dict[str, Any]:
        """The knob values the trial draws (define-by-run: asked here, then in its params)."""
        self._define(ot_trial)
        return dict(ot_trial.params)

    def _config(self, trial_id: str, ot_trial: optuna.Trial) -> dict[str, Any]:
        config = {**self._point(ot_trial), **self._define(ot_trial)}
        key = point_key(self._sweep_space, knob_point(config))
        ot_trial.set_user_attr("tune_trial_id", trial_id)
        earlier = self.measured(key)
        if earlier is not None and earlier.user_attrs.get("sweep_id") != self._sweep_id:
            # Measured by an earlier sweep of this study: reuse, do not run it again.
            config[REUSE_KEY] = {"from": earlier.number, "result": earlier.user_attrs["result"]}
            ot_trial.set_user_attr("reused_from", earlier.number)
        self._configs[trial_id] = config
        return config

    def _tell_repeat(self, ot_trial: optuna.Trial, key: str) -> None:
        """An ask that drew a point this sweep has: the sampler learns its result (or, while
        it runs, that this ask failed); no Tune trial is spent on it."""
        earlier = self.measured(key)
        ot_trial.set_user_attr("outcome", "repeat")
        if earlier is not None:
            ot_trial.set_user_attr("repeat_of", earlier.number)
            for name, value in earlier.constraints.items():
                ot_trial.set_constraint(name, value)
            values = earlier.values
            self._ot_study.tell(ot_trial, values[0] if len(values) == 1 else values)
        else:
            self._ot_study.tell(ot_trial, None, state=TrialState.FAIL)

    def save(self, checkpoint_path: str) -> None:
        """Tune checkpoints the searcher with the experiment (the study lives in its RDB)."""
        with open(checkpoint_path, "wb") as f:
            pickle.dump(self.__dict__.copy(), f)

    def restore(self, checkpoint_path: str) -> None:
        with open(checkpoint_path, "rb") as f:
            self.__dict__.update(pickle.load(f))
        self._closing = False  # a resumed sweep: its trials are told again

    def measured(self, key: str) -> optuna.trial.FrozenTrial | None:
        """The first finished trial of the study with this point key and a stored result."""
        for trial in self._ot_study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
            if trial.user_attrs.get("point_key") == key and stored_result(trial) is not None:
                return trial
        return None

    def on_trial_result(self, trial_id: str, result: dict[str, Any]) -> None:
        if isinstance(self.metric, list) or trial_id in self._completed_trials:
            return  # Optuna has no intermediate values for multi-objective studies
        if trial_id in self._reruns or trial_id not in self._ot_trials:
            return  # told FAIL when it was cut off; or a re-measurement, never told
        value = result.get(self.metric)
        if (
            result.get(STATUS_KEY) == TrialStatus.RUNNING
            and "step" in result  # a step's running throughput, not a phase report
            and value is not None
            and math.isfinite(value)
        ):
            try:
                self._ot_trials[trial_id].report(value, int(result["step"]))
            except optuna.exceptions.UpdateFinishedTrialError:
                # A resumed sweep reruns a trial its interrupted driver told FAIL.
                self._reruns.add(trial_id)

    def fail_unfinished(self, reason: str) -> None:
        """Tell FAIL for every trial still open (suggested or running when the sweep ended):
        the record of who was cut off. Nothing more is told in this process; a resumed
        sweep reruns them, each into an Optuna trial of its own (`rerun_of`)."""
        for trial_id, ot_trial in self._ot_trials.items():
            if trial_id in self._completed_trials:
                continue
            ot_trial.set_user_attr("outcome", "killed")
            ot_trial.set_user_attr("failure_class", reason)
            self._ot_study.tell(ot_trial, None, state=TrialState.FAIL)
        self._closing = True

    def on_trial_complete(
        self, trial_id: str, result: dict[str, Any] | None = None, error: bool = False
    ) -> None:
        if self._closing or trial_id in self._completed_trials or trial_id not in self._ot_trials:
            return
        ot_trial = self._ot_trials[trial_id]
        final = TrialResult.from_report(result)
        kind = outcome(final, error, reported=bool(result))
        value = final.objective(self._sweep_space.objective.primary.metric) if final else math.nan
        if kind == "ok" and math.isfinite(value):  # a candidate to measure again
            self._values[trial_id] = value
        frozen = self._ot_study.get_trials(deepcopy=False)[ot_trial.number]
        cut_off = frozen.state.is_finished() and frozen.user_attrs.get("outcome") == "killed"
        if frozen.state.is_finished() and not cut_off:
            # Told before the driver died (resume): the stored record stands.
            self._completed_trials.add(trial_id)
            return
        failure = final.failure_class if final else None
        attrs: dict[str, Any] = {
            "outcome": kind,
            "failure_class": failure.value if failure else "",
        }
        if final is not None and kind != "failed":
            attrs["result"] = durable_result(final)
        # Constraint-aware samplers (TPE, GP, NSGA-II) read these to learn infeasible regions.
        constraints = dict(zip(CONSTRAINTS, constraint_vector(final), strict=True))
        values, state = self._told(final, kind)
        if cut_off:
            # The interrupted driver told this trial FAIL (the record of who was cut off);
            # its rerun is a trial of its own, with the same point.
            rerun = optuna.trial.create_trial(
                state=state, values=values, params=frozen.params,
                distributions=frozen.distributions, constraints=constraints,
                user_attrs={**frozen.user_attrs, **attrs, "rerun_of": frozen.number},
            )  # fmt: skip
            self._ot_study.add_trial(rerun)
            self._completed_trials.add(trial_id)
            return
        for key, value in attrs.items():
            ot_trial.set_user_attr(key, value)
        for name, value in constraints.items():
            ot_trial.set_constraint(name, value)
        try:
            self._ot_study.tell(ot_trial, values[0] if values and len(values) == 1 else values,
                                state=state)  # fmt: skip
        except RuntimeError as exc:
            # GridSampler calls study.stop() once the grid is done, which only works inside
            # study.optimize; the tell itself is already stored. Tune's trial count ends the sweep.
            if "stop" not in str(exc).lower():
                raise
        self._completed_trials.add(trial_id)

    def _told(self, final: TrialResult | None, kind: str) -> tuple[list[float] | None, TrialState]:
        """The values and state a trial's outcome is told with."""
        objectives = self._sweep_space.objective.all
        if kind == "ok" and final is not None:
            values = [final.objective(o.metric) for o in objectives]
            state = TrialState.COMPLETE
        elif kind == "infeasible":
            # A value is required for COMPLETE; the constraint violation ranks it below any feasible point.
            values = [0.0 if o.mode == "max" else 1e30 for o in objectives]
            state = TrialState.COMPLETE
        else:
            values, state = None, TrialState.PRUNED if kind == "pruned" else TrialState.FAIL
        return values, state


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
