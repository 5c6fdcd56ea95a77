"""The sweep's searcher: Ray Tune's Searcher on Optuna's ask/tell, which turns each Tune
trial into one distinct point of the space and tells Optuna how it ended."""

from __future__ import annotations

import hashlib
import json
import math
import os
import pickle
import warnings
from pathlib import Path
from typing import Any

import optuna
from optuna.trial import TrialState
from ray.tune.search import Searcher

from sweeper.search.distributions import DefineByRun
from sweeper.search.outcomes import (
    CONSTRAINTS,
    Outcome,
    constraint_vector,
    durable_result,
    outcome,
    stored_result,
)
from sweeper.space.points import (
    PROFILE_KEY,
    REMEASURE_KEY,
    REUSE_KEY,
    assemble,
    knob_point,
    maxtext_knobs,
)
from sweeper.space.schema import Space
from trainer.trial.events import TrialStatus
from trainer.trial.result import STATUS_KEY, TrialResult

# Asks in a row that may draw points this sweep has before it is taken to have them all.
MAX_REPEATS = 50


def point_key(space: Space, point: dict[str, Any]) -> str:
    """Identity of a measurement: the whole trial configuration, fidelity and target, and for
    MaxText the program and its `maxtext.*` settings (not part of the trial configuration:
    without them, points that differ only in a MaxText setting were one point, and the
    sweep skipped all but the first as a repeat). Our trainer's keys are as they were."""
    what = {"trial": assemble(space, point), "fidelity": space.effective_fidelity,
            "target": str(space.target)}  # fmt: skip
    if space.program != "sweeper-trainer":
        what.update(program=space.program, settings=maxtext_knobs(point))
    return hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()[:20]


class _StoragePickler(pickle.Pickler):
    """Pickles the searcher with its Optuna storage as a name: the study, and each trial,
    refer to it; none pickles its connection."""

    def persistent_id(self, obj: Any) -> str | None:
        stored = isinstance(obj, optuna.storages.BaseStorage)  # an in-memory study is its pickle
        return (
            "optuna-storage"
            if stored and not isinstance(obj, optuna.storages.InMemoryStorage)
            else None
        )


class _StorageUnpickler(pickle.Unpickler):
    """The searcher's pickle read with its storage opened at `url` (one for all its refs)."""

    def __init__(self, file: Any, url: str | None):
        super().__init__(file)
        self._storage = optuna.storages.get_storage(url) if url else None

    def persistent_load(self, pid: Any) -> Any:
        if pid != "optuna-storage" or self._storage is None:
            raise pickle.UnpicklingError(f"unknown reference {pid!r} in the searcher's state")
        return self._storage


def moved_url(url: str, saved_at: Path, now_at: Path) -> str:
    """A SQLite `url` recorded with a file saved at `saved_at`, read with that file now at
    `now_at`: the folder the two paths end in common moved, and a database under it with it.
    Any other URL (a server, a file elsewhere) is as it was."""
    if not url.startswith("sqlite:///") or saved_at == now_at:
        return url
    old, new = saved_at, now_at
    while old.name == new.name and old.name:
        old, new = old.parent, new.parent
    path = Path(url.removeprefix("sqlite:///"))
    if old not in path.parents:
        return url
    return f"sqlite:///{new / path.relative_to(old)}"


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
        self._storage_url = storage if isinstance(storage, str) else getattr(storage, "url", None)
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
            return self._remeasure_config(trial_id)
        if trial_id in self._ot_trials:  # asked again for a trial it has (a restored sweep)
            return self._config(trial_id, self._ot_trials[trial_id])
        if self.exhausted or len(self._ot_trials) >= self._sweep_space.search.trials:
            return self._next_remeasure(trial_id)
        for _ in range(MAX_REPEATS):
            if not self._queued() and self._sweep_space.search.sampler != "grid":
                # Drawn where repeats are invisible: the study is asked once, for a new point.
                params = self._fresh_params()
                if params is None:
                    break
                self._ot_study.enqueue_trial(params)
            ot_trial = self._ot_study.ask()
            ot_trial.set_user_attr("sweep_id", self._sweep_id)
            key = point_key(self._sweep_space, self._point(ot_trial))
            ot_trial.set_user_attr("point_key", key)
            if key in self._points:  # a warm-start point listed twice
                self._tell_repeat(ot_trial, key)
                continue
            self._points[key] = trial_id
            self._ot_trials[trial_id] = ot_trial
            return self._config(trial_id, ot_trial)
        self.exhausted = True  # every recent draw was a point this sweep has: it has them all
        return self._next_remeasure(trial_id)

    def _queued(self) -> bool:
        """Whether the study holds points queued to run (the space's warm start)."""
        return bool(self._ot_study.get_trials(deepcopy=False, states=(TrialState.WAITING,)))

    def _fresh_params(self) -> dict[str, Any] | None:
        """A point this sweep has not run, drawn by the study's sampler from a scratch copy of
        the study (its running and ended trials): a draw that repeats a point is told there,
        with that point's result, and never reaches the study (whose trials are each a point
        once). None when the draws keep repeating: the sweep has every point."""
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            scratch = optuna.create_study(
                directions=self._ot_study.directions, sampler=self._ot_study.sampler
            )
            scratch.add_trials([t for t in self._ot_study.get_trials(deepcopy=False)
                                if t.state != TrialState.WAITING])  # fmt: skip
        for _ in range(MAX_REPEATS):
            draw = scratch.ask()
            params = self._point(draw)
            key = point_key(self._sweep_space, params)
            if key not in self._points:
                return params
            earlier = self.measured(key)
            if earlier is None:  # still running here: the draw teaches nothing, it is dropped
                scratch.tell(draw, None, state=TrialState.FAIL)
                continue
            for name, value in earlier.constraints.items():
                draw.set_constraint(name, value)
            values = earlier.values
            scratch.tell(draw, values[0] if len(values) == 1 else values)
        return None

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
        return self._remeasure_config(trial_id)

    def _remeasure_config(self, trial_id: str) -> dict[str, Any]:
        """The point trial `trial_id` measures again; the first (the best before the repeats)
        is profiled. Only it: a profiled run times two steps fewer, and the repeats' figures
        decide the best (table.ranking_figure)."""
        original = self._remeasures[trial_id]
        config = {**knob_point(self._configs[original]), REMEASURE_KEY: original}
        first = trial_id == next(iter(self._remeasures))
        return (
            {**config, PROFILE_KEY: True}
            if first and self._sweep_space.search.profile_best
            else config
        )

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
        """Tune checkpoints the searcher with the experiment. The study lives in its RDB: the
        pickle names it by where it was saved, never holds its storage (optuna's RDBStorage
        connects to the URL it was made with as it is unpickled, and makes the tables of an
        empty database there), so that a folder moved since (brought back from the host that
        ran it) has its study read where it is now."""
        with open(checkpoint_path, "wb") as f:
            pickle.dump(
                {"saved_at": os.path.abspath(checkpoint_path), "storage": self._storage_url}, f
            )
            _StoragePickler(f).dump(self.__dict__.copy())

    def restore(self, checkpoint_path: str) -> None:
        with open(checkpoint_path, "rb") as f:
            head = pickle.load(f)
            if "saved_at" not in head:  # saved before 2026-12-07: the state alone
                state, url = head, None
            else:
                url = moved_url(head["storage"], Path(head["saved_at"]),
                                Path(os.path.abspath(checkpoint_path)))  # fmt: skip
                state = _StorageUnpickler(f, url).load()
        self.__dict__.update(state)
        self._storage_url = url or getattr(self, "_storage_url", None)
        self._closing = False  # a resumed sweep: its trials are told again

    def reopen(self, storage: str) -> None:
        """The study read from `storage` (where the sweep's manifest now says it is), its
        trials with it: for a searcher saved before it named its study by place."""
        if storage == self._storage_url:
            return
        study = optuna.load_study(study_name=self._ot_study.study_name,
                                  storage=optuna.storages.RDBStorage(storage),
                                  sampler=self._ot_study.sampler, pruner=self._ot_study.pruner)  # fmt: skip
        for trial in self._ot_trials.values():
            # A Trial writes through its study's storage (optuna/trial/_trial.py, Trial.__init__).
            trial.study, trial.storage = study, study._storage
        self._ot_study = study
        self._storage_url = storage

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
        if kind == Outcome.OK and math.isfinite(value):  # a candidate to measure again
            self._values[trial_id] = value
        frozen = self._ot_study.get_trials(deepcopy=False)[ot_trial.number]
        cut_off = frozen.state.is_finished() and frozen.user_attrs.get("outcome") == "killed"
        if frozen.state.is_finished() and not cut_off:
            # Told before the driver died (resume): the stored record stands.
            self._completed_trials.add(trial_id)
            return
        failure = final.failure_class if final else None
        attrs: dict[str, Any] = {
            "outcome": kind.value,
            "failure_class": failure.value if failure else "",
        }
        if final is not None and kind != Outcome.FAILED:
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

    def _told(
        self, final: TrialResult | None, kind: Outcome
    ) -> tuple[list[float] | None, TrialState]:
        """The values and state a trial's outcome is told with."""
        objectives = self._sweep_space.objective.all
        if kind == Outcome.OK and final is not None:
            values = [final.objective(o.metric) for o in objectives]
            state = TrialState.COMPLETE
        elif kind == Outcome.INFEASIBLE:
            # A value is required for COMPLETE; the constraint violation ranks it below any feasible point.
            values = [0.0 if o.mode == "max" else 1e30 for o in objectives]
            state = TrialState.COMPLETE
        else:
            values, state = None, TrialState.PRUNED if kind == Outcome.PRUNED else TrialState.FAIL
        return values, state
