"""A sweep's lifecycle, the same for the CLI and the Python API: prepare -> tuner -> finish.

    sweep = Sweep.prepare("moe_short", trials=8)   # checks, reads the cluster, opens the records
    tuner = sweep.tuner(callbacks=[mine])           # a plain ray.tune.Tuner; builds, starts nothing
    tuner.fit()
    result = sweep.finish()                         # summary.csv, best.yaml, the parent run closed

`Sweep.resume(SWEEP_ID)` takes the place of `prepare` for a sweep whose driver died or was
stopped; `sweep.run()` is the three steps in one, and `run_sweep` is that for a space or
an id. Every side effect is in `prepare`/`resume` (Ray, the tracking store's parent run,
the Optuna study, the sweep folder), in Tune's `fit`, or in `finish`; `tuner()` only builds.
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import optuna
import pandas as pd
import yaml
from optuna.trial import TrialState
from ray import tune
from ray.tune.experiment import Trial
from ray.tune.schedulers import ASHAScheduler

from sweeper import ladder, results, tune_state
from sweeper.engine import (
    cap_grid,
    check_space,
    new_sweep_id,
    place,
    quiet,
    start_ray,
    stop_ray,
)
from sweeper.export import trial_config
from sweeper.inert import effect_caveats, program_verdicts
from sweeper.manifest import (
    MANIFEST,
    Ending,
    Found,
    SweepManifest,
    default_results_dir,
    find_sweep,
    now,
)
from sweeper.placement import Placement
from sweeper.programs import program_of
from sweeper.progress import ProgressCallback
from sweeper.search import SweepSearch, check_study, close_open_trials, make_sampler, stored_result
from sweeper.space import Space, SpaceError, load_space, space_overrides
from sweeper.stores import open_stores
from sweeper.tracking import (
    Tracker,
    TrackingCallback,
    check_tracking_server,
    default_tracking_uri,
)
from sweeper.trainable import TrialRuntime, run_trial
from trainer.spec.config import TrialConfig
from trainer.spec.events import FailureClass, TrialStatus
from trainer.spec.files import UNWRITABLE, write_text
from trainer.spec.result import TrialResult

JOURNAL = "tracking_journal.json"  # tracking writes waiting for the store to come back
ID_MAP = "mlflow_runs.json"  # trial -> tracking run, and each trial's attempts
# A trial whose Ray worker or host died is retried this many times (a trial fault never is).
INFRA_RETRIES = 2
# Seconds between saves of Tune's experiment state (Tune's default: 10 s or more). A trial
# started within this window of a driver's death is unknown to a resume; its records are
# closed as killed and Tune runs another in its place.
TUNE_STATE_EVERY_S = "2"


class ResultsUnwritable(SpaceError):
    """The sweep's end could not be written where its results go: what was not written, why,
    and how to finish it (`sweeper resume`, once there is room)."""

    def __init__(self, sweep_id: str, folder: Path, unwritten: list[str]):
        super().__init__(
            f"sweep {sweep_id}: the results folder {folder} took no more writes "
            f"({'; '.join(unwritten)}). The trials' records are kept where they were written "
            f"(Optuna, MLflow, the trials' folders). Free space (or make it writable), then "
            f"`sweeper resume {sweep_id}` writes the summary, best.yaml and the report",
            file=str(folder),
        )


class SweepFinished(SpaceError):
    """`resume` of a sweep that ended well: nothing to continue."""

    def __init__(self, path: Path, manifest: SweepManifest):
        ending = manifest.ending
        super().__init__(
            f"sweep {manifest.sweep_id} finished at {ending.ended_at} ({ending.counts}; best "
            f"trial {ending.best_trial or 'none'}): nothing to resume. `sweeper show "
            f"{manifest.sweep_id}` shows it",
            file=str(path),
        )
        self.manifest = manifest


def unfinished(sweep_id: str, results_dir: Path | None, tracking_uri: str | None) -> Found:
    """The sweep to resume; SweepFinished (after replaying any records an outage kept) when
    it ended well. Needs no Ray: the CLI asks before it starts one."""
    found = find_sweep(sweep_id, results_dir)
    manifest = found.manifest
    assert manifest is not None, "find_sweep reads the manifest"
    if manifest.ending.state == "finished":
        if (found.path / JOURNAL).exists():  # records an outage kept: replay them now
            Tracker(tracking_uri or manifest.tracking_uri, manifest.space, manifest.sweep_id,
                    found.path.parents[1] / "mlartifacts", found.path / JOURNAL,
                    parent_run_id=manifest.parent_run_id).flush()  # fmt: skip
        raise SweepFinished(found.path, manifest)
    return found


@dataclass
class SweepResult:
    """What a sweep produced: every trial (one row each), the best feasible one, and the record ids."""

    space: str
    sweep_id: str
    trials: pd.DataFrame
    best: dict[str, Any] | None
    experiment_id: str
    parent_run_id: str
    tracking_uri: str
    study_name: str
    optuna_storage: str
    sweep_dir: Path
    counts: dict[str, int] = field(default_factory=dict)
    # Values pinned before sampling, and knobs the trials reported inert/emulated/interpreted.
    notes: list[str] = field(default_factory=list)
    interrupted: bool = False  # Ctrl-C / SIGTERM ended it; its running trials were killed
    journaled: int = 0  # tracking records still waiting in the journal (the store was down)
    space_used: Space | None = None  # the space as run: fidelity resolved, inert values pinned
    # The best trial's configuration as it ran, devices included: `python -m trainer` reruns it.
    best_config: dict[str, Any] | None = None

    def study(self) -> optuna.Study:
        return optuna.load_study(study_name=self.study_name, storage=self.optuna_storage)


@dataclass
class Sweep:
    """One sweep: its checked space, where its trials run, and where its records live."""

    space: Space
    sweep_id: str
    results_dir: Path
    tracking_uri: str
    tracker: Tracker
    tracking: TrackingCallback
    study_name: str
    optuna_storage: str
    placement: Placement
    storage: str
    concurrency: int
    inert_notes: list[str] = field(default_factory=list)
    placement_notes: list[str] = field(default_factory=list)
    own_study: bool = True  # False when --study continues a study shared with other sweeps
    resumed: bool = False  # reattached by `resume`: the tuner restores Tune's experiment
    result: SweepResult | None = None  # set once, by finish()
    unwritable: ResultsUnwritable | None = None  # finish() could not write the results
    # Made by prepare (it opens the Optuna study); None once resumed, when Tune restores
    # its pickled searcher. Kept to close trials an interruption cut off.
    searcher: SweepSearch | None = None
    interrupted: bool = False
    watching_ctrl_c: bool = False  # run() tells a Ctrl-C between trials (_watching_ctrl_c)
    started_at: str = field(default_factory=now)

    @property
    def sweep_dir(self) -> Path:
        return self.results_dir / self.space.name / self.sweep_id

    # -- prepare ------------------------------------------------------------------------

    @classmethod
    def prepare(
        cls,
        space: Space | str | Path,
        *,
        results_dir: Path | None = None,
        tracking_uri: str | None = None,
        sweep_id: str | None = None,
        storage: str | None = None,
        study: str | None = None,
        **overrides: Any,
    ) -> Sweep:
        """Check the space, read the Ray cluster, open the sweep's records.

        Uses the Ray the caller initialized (its own cluster), or starts a private local
        one. Trials reserve what the placement says (a whole TPU slice, the driver host's
        GPUs, or its CPU cores); a target the cluster lacks is refused (SpaceError). A
        tracking store that cannot be reached is a ConnectionError. `storage` is a path
        every node sees (Tune's state, the convergence cache; default results_dir);
        `study` continues an existing Optuna study. `overrides` are dotted space keys
        (`trials=4`, `set={"trial.steps": 10}`) applied when the space is loaded.
        """
        if not isinstance(space, Space):
            space = load_space(space, space_overrides(overrides))
        elif overrides:
            raise TypeError(
                "overrides apply when the space is loaded: pass a path or name, or edit the Space"
            )
        written, screened = space, None
        if space.search.ladder is not None:  # the screen, in this process: the trials compile
            space, screened = ladder.verify_rung(space)
        start_ray()
        space, placement, inert_notes, placement_notes = checked(space)
        results_dir = Path(results_dir or default_results_dir()).resolve()
        results_dir.mkdir(parents=True, exist_ok=True)
        storage = storage or str(results_dir)
        tracking_uri = tracking_uri or default_tracking_uri(results_dir)
        sweep_id = sweep_id or new_sweep_id()
        optuna_storage = f"sqlite:///{results_dir / 'optuna.db'}"
        open_stores(results_dir, tracking_uri, optuna_storage)  # schemas made by one at a time
        study_name = study or f"{space.name}-{sweep_id}"
        try:
            check_study(space, study_name, optuna_storage)
        except ValueError as exc:
            raise SpaceError(str(exc), field="--study") from None
        sweep_dir = results_dir / space.name / sweep_id
        sweep_dir.mkdir(parents=True, exist_ok=True)
        if screened is not None:
            ladder.write_screen(sweep_dir, screened, written)
        tracker = Tracker(
            tracking_uri, space, sweep_id, results_dir / "mlartifacts", sweep_dir / JOURNAL
        )
        tracker.start_sweep(
            yaml.safe_dump(space.model_dump(mode="json"), sort_keys=False),
            {
                "target": space.target,
                "fidelity": space.effective_fidelity,
                "sampler": space.search.sampler,
                "backend": placement.backend,
                "placement": placement.description,
                "inert": "; ".join(inert_notes) or "none",
            },
        )
        sweep = cls(
            space=with_trial_base(space, placement, storage),
            sweep_id=sweep_id,
            results_dir=results_dir,
            tracking_uri=tracking_uri,
            tracker=tracker,
            tracking=TrackingCallback(tracker, sweep_dir / ID_MAP),
            study_name=study_name,
            optuna_storage=optuna_storage,
            placement=placement,
            storage=storage,
            concurrency=concurrency(space, placement)[0],
            inert_notes=inert_notes,
            placement_notes=placement_notes,
            own_study=study is None,
        )
        sweep.searcher = sweep._searcher()  # the Optuna study, warm-start points enqueued
        sweep.write_manifest()
        return sweep

    @classmethod
    def resume(
        cls, sweep_id: str, *, results_dir: Path | None = None, tracking_uri: str | None = None
    ) -> Sweep:
        """Reattach a sweep begun earlier: its space, study, tracking runs and Tune state.

        Finished trials stay finished; trials the driver's death cut off run again once.
        """
        found = unfinished(sweep_id, results_dir, tracking_uri)
        manifest = found.manifest
        assert manifest is not None, "find_sweep reads the manifest"
        results_dir, sweep_dir = found.path.parents[1], found.path
        sweep_id, space = manifest.sweep_id, manifest.space
        _check_study(manifest.study_name, manifest.optuna_storage, sweep_id)
        start_ray()
        _, placement = place(space)
        tracking_uri = tracking_uri or manifest.tracking_uri
        check_tracking_server(tracking_uri)
        tracker = Tracker(tracking_uri, space, sweep_id, results_dir / "mlartifacts",
                          sweep_dir / JOURNAL, parent_run_id=manifest.parent_run_id)  # fmt: skip
        tracker.tag(tracker.parent, {"resumed_at": now()})
        sweep = cls(
            space=space,
            sweep_id=sweep_id,
            results_dir=results_dir,
            tracking_uri=tracking_uri,
            tracker=tracker,
            tracking=TrackingCallback(tracker, sweep_dir / ID_MAP),
            study_name=manifest.study_name,
            optuna_storage=manifest.optuna_storage,
            placement=placement,
            storage=manifest.storage,
            concurrency=concurrency(space, placement)[0],
            inert_notes=manifest.inert_notes,
            placement_notes=[f"placement: {placement.description}", f"resumed sweep {sweep_id}"],
            own_study=manifest.own_study,
            resumed=True,
            started_at=manifest.started_at,
        )
        sweep.tuner_path()  # refuse now, not at fit(), when Tune has nothing to restore
        sweep.check_tune_state()
        return sweep

    def check_tune_state(self) -> None:
        """Refuse to resume from Tune state that Tune could not read (it would start the
        experiment afresh and call the sweep complete with part of its trials), once a cut
        storage copy has been mended from Ray's staging copy where that is whole."""
        experiment = _local(self.tuner_path())
        if experiment is None:
            return  # remote storage: Tune reads it
        mended = tune_state.mend(experiment)
        if mended:
            self.placement_notes.append(mended)
        lost = tune_state.problems(experiment)
        known = self.known_trials()
        if not lost or not any(finished for _, finished in known):
            return  # whole, or nothing ended yet: a fresh start loses nothing
        closed = self.close_leftovers()
        self.tracker.terminate(self.tracker.parent, "KILLED")  # the sweep did not end well
        raise SpaceError(
            f"sweep {self.sweep_id}: Tune's state could not be read ({'; '.join(lost)}) and "
            "Ray's own copy of it is gone. Resuming would start the experiment afresh and call "
            "the sweep complete with part of its trials, so it is not resumed. What its records "
            f"hold ({len(known)} trial(s)): "
            + "; ".join(line for line, _ in known)
            + (f". {'; '.join(closed)}" if closed else "")
            + f". To go on, `sweeper run <the space of '{self.space.name}'> --study "
            f"{self.study_name}` continues its Optuna study: points it measured are reused, "
            "not run again",
            file=str(experiment),
            field="sweeper resume",
        )

    def known_trials(self) -> list[tuple[str, bool]]:
        """Each trial of this sweep that Optuna or MLflow knows, by Tune trial id, with whether
        it ended: `(what each record says, ended)`."""
        study = optuna.load_study(study_name=self.study_name, storage=self.optuna_storage)
        told = {
            str(t.user_attrs["tune_trial_id"]): t
            for t in study.get_trials(deepcopy=False)
            if t.user_attrs.get("sweep_id") == self.sweep_id and t.user_attrs.get("tune_trial_id")
        }
        tracker = self.tracker
        status = {
            run_id: state
            for state in ("FINISHED", "FAILED", "KILLED", "RUNNING")
            for run_id in tracker.store.search(
                tracker.experiment_id, {"sweeper.sweep_id": self.sweep_id}, status=state
            )
        }
        runs = {k: tracker.resolve(v) for k, v in self.tracking.run_ids.items()}
        known = []
        for trial_id in sorted(set(told) | set(runs)):
            said, ended = [], False
            if trial_id in told:
                t = told[trial_id]
                value = "" if t.values is None else " " + "/".join(f"{v:,.0f}" for v in t.values)
                said.append(f"Optuna #{t.number} {t.state.name}{value}")
                ended |= t.state.is_finished() and t.state != TrialState.FAIL
            if trial_id in runs:
                state = status.get(runs[trial_id], "unknown")
                said.append(f"MLflow {state}")
                ended |= state in ("FINISHED", "FAILED")
            known.append((f"{trial_id} ({', '.join(said)})", ended))
        return known

    def write_manifest(self, ending: Ending | None = None) -> None:
        manifest = SweepManifest(
            sweep_id=self.sweep_id,
            space=self.space,
            study_name=self.study_name,
            own_study=self.own_study,
            optuna_storage=self.optuna_storage,
            tracking_uri=self.tracking_uri,
            experiment_id=self.tracker.experiment_id,
            parent_run_id=self.tracker.parent_run_id or "",
            storage=self.storage,
            inert_notes=self.inert_notes,
            started_at=self.started_at,
            ending=ending or Ending(),
        )
        manifest.write(self.sweep_dir / MANIFEST)

    # -- tuner ----------------------------------------------------------------------------

    @property
    def experiment_name(self) -> str:
        """Tune's experiment: the study's name, plus the sweep id when a study is shared."""
        return self.study_name if self.own_study else f"{self.study_name}-{self.sweep_id}"

    @property
    def experiment_path(self) -> str:
        """Tune's experiment folder in the sweep's storage."""
        return f"{self.storage}/ray/{self.experiment_name}"

    def tuner_path(self) -> str:
        path = self.experiment_path
        if self.resumed and not tune.Tuner.can_restore(path):
            raise SpaceError(
                f"sweep {self.sweep_id}: no Tune experiment state at {path} (did the first trial start?)",
                file="sweeper resume",
                field="SWEEP_ID",
            )
        return path

    def tuner(
        self, callbacks: list[tune.Callback] | None = None, progress: bool = False
    ) -> tune.Tuner:
        """A ray.tune.Tuner for this sweep (restored from Tune's state when resumed).

        `callbacks` are added to the sweep's own (tracking, finish, optional progress);
        the sweep finishes itself when Tune's experiment ends.
        """
        os.environ.setdefault("TUNE_GLOBAL_CHECKPOINT_S", TUNE_STATE_EVERY_S)
        all_callbacks: list[tune.Callback] = [self.tracking, FinishCallback(self)]
        if progress:
            all_callbacks.append(ProgressCallback(self.space))
        all_callbacks += callbacks or []
        LIVE_CALLBACKS[self.sweep_id] = all_callbacks
        runtime = TrialRuntime(
            placement=self.placement, timeout_s=self.space.search.trial_timeout_s
        )
        trainable = tune.with_resources(
            tune.with_parameters(
                run_trial, space=self.space, runtime=runtime, recorded=self.recorded_results()
            ),
            self.placement.trial_resources,
        )
        if self.resumed:
            return self._restored_tuner(trainable)
        run_config = tune.RunConfig(
            name=self.experiment_name,
            storage_path=f"{self.storage}/ray",
            callbacks=[SweepCallbacks(self.sweep_id)],
            # A trial whose worker or host died is retried; a trial fault is a result, never raised.
            failure_config=tune.FailureConfig(max_failures=INFRA_RETRIES, fail_fast=False),
            verbose=0,
        )
        return tune.Tuner(trainable, tune_config=self._tune_config(), run_config=run_config)

    def _searcher(self) -> SweepSearch:
        space, objective = self.space, self.space.objective
        single = objective.secondary is None
        return SweepSearch(
            space,
            sweep_id=self.sweep_id,
            metric=objective.primary.metric if single else objective.metrics,
            mode=objective.primary.mode if single else objective.modes,
            sampler=make_sampler(space),
            study_name=self.study_name,
            storage=optuna.storages.RDBStorage(self.optuna_storage),
            points_to_evaluate=space.search.warm_start or None,
            remeasure=self.remeasure,
        )

    @property
    def remeasure(self) -> int:
        """Points measured again once the search's trials have ended (run fidelity only)."""
        return self.space.search.remeasure_count(self.space.effective_fidelity)

    def _tune_config(self) -> tune.TuneConfig:
        space, objective = self.space, self.space.objective
        scheduler = None
        if space.search.early_stopping and objective.secondary is None:
            steps = int(space.trial.get("steps", TrialConfig.model_fields["steps"].default))
            scheduler = ASHAScheduler(
                time_attr="step",  # in step reports only: phase and final reports pass it by
                metric=objective.primary.metric,
                mode=objective.primary.mode,
                max_t=steps,
                grace_period=max(3, steps // 4),
            )
        return tune.TuneConfig(
            search_alg=self.searcher,
            scheduler=scheduler,
            num_samples=space.search.trials + self.remeasure,
            max_concurrent_trials=self.concurrency,
            time_budget_s=space.search.time_budget_s,
            reuse_actors=False,
            trial_dirname_creator=lambda trial: f"trial_{trial.trial_id}",
        )

    def _restored_tuner(self, trainable: Any) -> tune.Tuner:
        # The restored RunConfig's callbacks are a SweepCallbacks of this sweep's id: they
        # reach the callbacks this process registered for it, not the first driver's.
        return tune.Tuner.restore(
            self.tuner_path(), trainable, resume_unfinished=True, resume_errored=False,
            restart_errored=False,
        )  # fmt: skip

    def recorded_results(self) -> dict[str, TrialResult]:
        """Trials Tune will restart that must not run again, by Tune trial id, with their result.

        Told to Optuna before the driver died (Tune's checkpoint is older): their stored
        result. Interrupted once already (attempts >= 2): a failure; a trial is retried once.
        """
        if not self.resumed:
            return {}
        recorded: dict[str, TrialResult] = {}
        study = optuna.load_study(study_name=self.study_name, storage=self.optuna_storage)
        for trial in study.get_trials(deepcopy=False):
            attrs = trial.user_attrs
            tune_id = attrs.get("tune_trial_id")
            if not tune_id or attrs.get("sweep_id") != self.sweep_id:
                continue
            stored = stored_result(trial)
            if trial.state.is_finished() and stored is not None:
                recorded[tune_id] = stored
            elif not trial.state.is_finished() and self.tracking.attempts.get(tune_id, 0) >= 2:
                recorded[tune_id] = TrialResult.failed(
                    FailureClass.CRASHED,
                    "interrupted twice (the sweep's driver died while it ran); not retried again",
                )
        return recorded

    # -- finish ---------------------------------------------------------------------------

    def finish(self, trials: list[Trial] | None = None) -> SweepResult:
        """Summary files, notes and the parent run, from Tune's trials (restored ones included).

        Runs once, when Tune's experiment ends (the sweep's own callback); later calls
        return that result.
        """
        if self.result is None and self.unwritable is None:
            try:
                self.result = self._finish(trials)
            except ResultsUnwritable as exc:  # raised to the caller once Tune has returned
                self.unwritable = exc
        if self.unwritable is not None:
            raise self.unwritable
        assert self.result is not None
        return self.result

    def _finish(self, trials: list[Trial] | None) -> SweepResult:
        tracking, space = self.tracking, self.space
        rows = results.rows(
            trials if trials is not None else tracking.seen.values(),
            tracking.finals,
            tracking.run_id,
            tracking.attempts,
        )
        frame = results.remeasured(pd.DataFrame(rows), space.objective.primary.metric)
        experiment = _local(self.experiment_path)
        if experiment is not None and "profile_dir" in frame:  # the copy that outlives Ray's
            frame["profile_dir"] = [
                tune_state.in_storage(str(p), experiment) if isinstance(p, str) else p
                for p in frame["profile_dir"]
            ]
        frame, ladder_notes = self._ladder(frame)
        search = results.searched(frame)  # counts are the search's; re-measurements apart
        counts = {"total": len(search)}
        if not search.empty:
            counts.update({str(k): int(v) for k, v in search["status"].value_counts().items()})
        if len(search) < len(frame):
            counts["remeasured"] = len(frame) - len(search)
        best = _best(frame, space)
        unwritten: list[str] = []  # a full results folder: what could not be written, and why

        def keep(what: str, write: Callable[[], Any]) -> Any:
            try:
                return write()
            except OSError as exc:
                if exc.errno not in UNWRITABLE:
                    raise
                unwritten.append(f"{what}: {exc.strerror}")
                return None

        keep(
            "summary.csv",
            lambda: write_text(self.sweep_dir / "summary.csv", frame.to_csv(index=False)),
        )
        best_config = keep("best.yaml", lambda: self._write_best(best)) if best else None
        notes = [
            *self.placement_notes,
            *(f"pinned: {n}" for n in self.inert_notes),
            *effect_caveats(list(frame["effects"]) if "effects" in frame else []),
            *program_verdicts(frame),
            *ladder_notes,
            *results.noise_notes(
                frame, space.objective.primary.metric, space.objective.primary.mode == "max"
            ),
        ]
        if "reused_from" in frame and frame["reused_from"].notna().any():
            reused = int(frame["reused_from"].notna().sum())
            notes.append(f"reused: {reused} trial(s) asked for a point this study had measured")
        if self.interrupted:
            notes.append("interrupted: trials still running were killed and recorded as such")
        if self.searcher is not None and self.searcher.exhausted:
            notes.append(
                f"the space ran out of new points after {len(search)} trials: every point the "
                "sampler drew again had run in this sweep"
            )
        notes += self.close_leftovers()
        self.tracker.flush()  # a store back by now: the outage is in the notes it keeps
        notes += self.tracker.outages
        told = len(self.tracker.outages)
        report = keep("report.html", lambda: self.write_report(frame, notes))
        if report is not None:
            keep("the report's MLflow artifact", lambda: self.tracker.log_report(report))
        if unwritten:
            notes.append(f"results folder full, not written: {'; '.join(unwritten)}")
        # Every run is closed even when the folder is full: KILLED, as the sweep did not end well.
        self.tracker.finish_sweep(
            best, counts, status="KILLED" if self.interrupted or unwritten else "FINISHED",
            notes=notes,
        )  # fmt: skip
        journaled = self.tracker.flush()
        notes += self.tracker.outages[told:]
        if journaled:
            notes.append(
                f"tracking store still unreachable: {journaled} records wait in "
                f"{self.tracker.journal.path}; `sweeper resume {self.sweep_id}` replays them once it answers"
            )
        if unwritten:  # no ending in sweep.json: `sweeper resume` finishes it once there is room
            raise ResultsUnwritable(self.sweep_id, self.sweep_dir, unwritten)
        self.write_manifest(
            Ending(
                state="interrupted" if self.interrupted else "finished",
                ended_at=now(),
                counts=counts,
                best_trial=str(best["trial_id"]) if best else "",
                best_value=float(best[space.objective.primary.metric]) if best else None,
                notes=notes,
            )
        )
        if experiment is not None and not journaled and not self.interrupted:
            # Ended well, every record written: Ray's staging copies are no longer needed (an
            # unfinished sweep keeps them: resume mends a cut storage copy from them).
            tune_state.clean_staging(self.experiment_name)
        return SweepResult(
            space=space.name,
            sweep_id=self.sweep_id,
            trials=frame,
            best=best,
            experiment_id=self.tracker.experiment_id,
            parent_run_id=self.tracker.parent,
            tracking_uri=self.tracking_uri,
            study_name=self.study_name,
            optuna_storage=self.optuna_storage,
            sweep_dir=self.sweep_dir,
            notes=notes,
            counts=counts,
            interrupted=self.interrupted,
            journaled=journaled,
            space_used=space,
            best_config=best_config,
        )

    def _ladder(self, frame: pd.DataFrame) -> tuple[pd.DataFrame, list[str]]:
        """A ladder's verify rung joined to its screen (ranks, correlation: summary.csv, MLflow,
        ladder.csv) and its run rung written; a sweep without a ladder is left as it is."""
        if self.space.search.ladder is None or frame.empty:
            return frame, []
        if not (self.sweep_dir / ladder.SCREEN_CSV).exists():
            return frame, [f"ladder: {ladder.SCREEN_CSV} is missing: the rungs cannot be joined"]
        frame, notes, figures = ladder.verified(frame, self.sweep_dir, self.space)
        notes += ladder.run_rung(self.sweep_dir, frame, self.space)[1]
        self.tracker.log_ladder(frame, self.sweep_dir / ladder.LADDER_CSV, figures)
        return frame, notes

    def write_report(self, frame: pd.DataFrame, notes: list[str]) -> Path:
        """The sweep's HTML report (sweeper/report.py), beside summary.csv."""
        from sweeper import report

        study = optuna.load_study(study_name=self.study_name, storage=self.optuna_storage)
        objective = self.space.objective.primary
        return report.write_report(
            self.sweep_dir,
            frame,
            title=f"{self.space.name}: sweep {self.sweep_id}",
            metric=objective.metric,
            maximize=objective.mode == "max",
            notes=notes,
            importances=report.importances_of(study, self.sweep_id),
        )

    def best_config(self, point: dict[str, Any]) -> dict[str, Any]:
        """A point's trial configuration as it ran, devices included: what `python -m
        trainer --config FILE` reruns (sweeper/export.py)."""
        config = trial_config(self.space, point, self.placement.num_devices)
        return config.model_dump(mode="json", exclude_defaults=True)

    def _write_best(self, best: dict[str, Any]) -> dict[str, Any]:
        metric = self.space.objective.primary.metric
        point = {
            name: best[column]
            for column, name in results.knob_columns(best).items()
            if not results.missing(best[column])
        }
        config = self.best_config(point)
        write_text(
            self.sweep_dir / "best.yaml",
            yaml.safe_dump(
                {
                    "trial_id": best["trial_id"],
                    "knobs": point,
                    metric: float(best[metric]),
                    "fidelity": best.get("fidelity"),
                    "hardware": best.get("hardware"),
                    "program_fingerprint": best.get("program_fingerprint"),
                    "trial": config,
                },
                sort_keys=False,
            ),
        )
        return config

    def close_leftovers(self) -> list[str]:
        """Close what a killed driver left open: Optuna trials and tracking runs still RUNNING."""
        notes = []
        study = optuna.load_study(study_name=self.study_name, storage=self.optuna_storage)
        closed = close_open_trials(study, self.sweep_id, self.own_study)
        if closed:
            notes.append(f"closed {closed} Optuna trial(s) a killed driver left RUNNING (FAIL)")
        if not len(self.tracker.journal):
            killed = self.tracker.close_leftovers()
            if killed:
                notes.append(
                    f"closed {killed} tracking run(s) a killed driver left RUNNING (KILLED)"
                )
        return notes

    # -- all three ------------------------------------------------------------------------

    def run(
        self, callbacks: list[tune.Callback] | None = None, progress: bool = False
    ) -> SweepResult:
        tuner = self.tuner(callbacks, progress)
        with _watching_ctrl_c(self):
            try:
                tuner.fit()
            except BaseException:  # a store gone or full, a second Ctrl-C: no run left RUNNING
                self.abandon()
                raise
        return self.finish()

    def abandon(self) -> None:
        """Close this sweep's runs KILLED when its experiment died with an error (best effort:
        a store that cannot take them keeps them in the journal, and `resume` replays it)."""
        with contextlib.suppress(Exception):
            self.tracker.close_leftovers()
        with contextlib.suppress(Exception):
            self.tracker.terminate(self.tracker.parent, "KILLED")


def _check_study(name: str, storage: str, sweep_id: str) -> None:
    """The sweep's Optuna study must still be where it began: the search's memory (and each
    trial's result) is there; without it a resume cannot tell what ran."""
    try:
        optuna.load_study(study_name=name, storage=storage)
    except KeyError:
        raise SpaceError(
            f"sweep {sweep_id}: its Optuna study '{name}' is not in {storage} (the file was "
            "deleted or replaced), so the sweep cannot be resumed. Its trials' records are in "
            f"MLflow and summary.csv if it was written (`sweeper show {sweep_id}`); put the "
            "study's file back to resume, or start a new sweep",
            file=storage.removeprefix("sqlite:///"),
            field="sweeper resume",
        ) from None


def _local(path: str) -> Path | None:
    """A storage path on this machine's filesystem, or None for remote storage (s3://, ...)."""
    if path.startswith("file://"):
        return Path(path.removeprefix("file://"))
    return None if "://" in path else Path(path)


def checked(space: Space) -> tuple[Space, Placement, list[str], list[str]]:
    """The space as its sweep runs it, where its trials run, the values pinned as inert
    (a note each), and notes on the placement."""
    program_of(space).check(space)
    space, placement = place(space)
    backend = placement.backend if space.effective_fidelity == "run" else None
    space, inert_notes = check_space(space, backend, placement.num_devices)
    space, grid_note = cap_grid(space)
    notes = [f"placement: {placement.description}", *grid_note, *concurrency(space, placement)[1]]
    return space, placement, inert_notes, notes


def concurrency(space: Space, placement: Placement) -> tuple[int, list[str]]:
    """Trials at once: the space's, capped at what the cluster holds (with a note then)."""
    allowed = min(space.search.concurrency, placement.capacity)
    if allowed == space.search.concurrency:
        return allowed, []
    many = "s" if placement.capacity > 1 else ""
    return allowed, [
        f"search.concurrency {space.search.concurrency} capped at {allowed}: "
        f"the cluster holds {placement.capacity} such trial{many} at once"
    ]


def with_trial_base(space: Space, placement: Placement, storage: str) -> Space:
    """The trial base every trial of the sweep shares: where the trainers run, the cache."""
    base = space.base_trial()
    if space.effective_fidelity == "run":
        base["backend"] = placement.backend  # the trainers run where the sweep reserved
    # The convergence reference cache lives in the sweep's storage, which every node reads.
    base.setdefault("convergence", {}).setdefault("cache_dir", f"{storage}/cache")
    return space.model_copy(update={"trial": {k: v for k, v in base.items() if k != "model"}})


# The callbacks of each sweep this process drives, by sweep id (see SweepCallbacks).
LIVE_CALLBACKS: dict[str, list[tune.Callback]] = {}
_HOOKS = ("setup", "on_step_begin", "on_step_end", "on_trial_start", "on_trial_restore",
          "on_trial_save", "on_trial_result", "on_trial_complete", "on_trial_recover",
          "on_trial_error", "on_checkpoint", "on_experiment_end")  # fmt: skip


class SweepCallbacks(tune.Callback):
    """What Tune calls back for a sweep: every hook goes to the callbacks the sweep's driver
    registered for it in this process (its tracking, finish and progress callbacks, and the
    caller's). Tune pickles callbacks with its experiment state and revives them when a
    sweep is resumed; this one holds only the sweep id, so a resumed sweep reports to
    callbacks rebuilt from its durable records, not to copies of the first driver's."""

    def __init__(self, sweep_id: str):
        self.sweep_id = sweep_id


def _forward(hook: str) -> Callable[..., None]:
    def forward(self: SweepCallbacks, *args: Any, **kwargs: Any) -> None:
        for callback in LIVE_CALLBACKS.get(self.sweep_id, []):
            getattr(callback, hook)(*args, **kwargs)

    forward.__name__ = hook
    return forward


for _hook in _HOOKS:
    setattr(SweepCallbacks, _hook, _forward(_hook))


class FinishCallback(tune.Callback):
    """Finishes the sweep when Tune's experiment ends: summary files and the parent run."""

    def __init__(self, sweep: Sweep):
        self.sweep = sweep

    def on_experiment_end(self, trials: list[Trial], **info: Any) -> None:
        # Trials that started and never completed were cut off by Ctrl-C / SIGTERM (Tune
        # marks them TERMINATED when it stops them): close their records.
        tracking = self.sweep.tracking
        cut = [
            t
            for t in trials
            if t.trial_id in tracking.run_ids
            and t.trial_id not in tracking.finished
            and t.status != "ERROR"
            and not _ended(t)
        ]
        for trial in cut:
            tracking.kill(trial)
        # Created but never started (Ctrl-C between trials): no run, no row; resume runs them.
        unstarted = [
            t
            for t in trials
            if t.trial_id not in tracking.run_ids and t.status != "ERROR" and not _ended(t)
        ]
        if self.sweep.searcher is not None:
            self.sweep.searcher.fail_unfinished("killed: the sweep was interrupted")
        self.sweep.interrupted = bool(cut or unstarted or _ctrl_c(self.sweep))
        # A full results folder is kept by the sweep: its run() raises it once Tune returns.
        with contextlib.suppress(ResultsUnwritable):
            self.sweep.finish(trials)


def _sigint_marker(signum: int, frame: Any) -> None:
    """SIGINT's handler while a sweep's fit runs. Tune's fit installs its own and, on the first
    Ctrl-C / SIGTERM, puts back the one it found: this one. Finding it back at the
    experiment's end tells the interruption even between trials, when no trial was cut; a
    second signal reaches it and raises KeyboardInterrupt, as Python's default does."""
    raise KeyboardInterrupt


@contextlib.contextmanager
def _watching_ctrl_c(sweep: Sweep) -> Iterator[None]:
    try:
        before = signal.signal(signal.SIGINT, _sigint_marker)
    except ValueError:  # not the main thread: no handler, and none of Tune's either
        yield
        return
    sweep.watching_ctrl_c = True
    try:
        yield
    finally:
        sweep.watching_ctrl_c = False
        signal.signal(signal.SIGINT, before)


def _ctrl_c(sweep: Sweep) -> bool:
    """Whether Tune's fit was stopped by Ctrl-C / SIGTERM (run() watching)."""
    return sweep.watching_ctrl_c and signal.getsignal(signal.SIGINT) is _sigint_marker


def _ended(trial: Trial) -> bool:
    final = TrialResult.from_report(trial.last_result)
    return final is not None and final.ended


def _best(frame: pd.DataFrame, space: Space) -> dict[str, Any] | None:
    primary = space.objective.primary
    frame = results.searched(frame)  # a re-measurement repeats a point: its first trial ranks
    ok = frame[frame["status"] == TrialStatus.OK] if not frame.empty else frame
    if ok.empty:
        return None
    ranked = ok.sort_values(primary.metric, ascending=primary.mode == "min")
    return {str(k): v for k, v in ranked.iloc[0].to_dict().items()}


def run_sweep(
    space: Space | str | Path | None = None,
    *,
    results_dir: Path | None = None,
    tracking_uri: str | None = None,
    progress: bool = False,
    callbacks: list[tune.Callback] | None = None,
    storage: str | None = None,
    study: str | None = None,
    resume: str | None = None,
    verbose: bool = False,
    **overrides: Any,
) -> SweepResult:
    """Run a whole sweep and return its result; overrides are dotted space keys (`search.trials=4`).

    `resume=SWEEP_ID` continues a sweep whose driver died or was stopped instead. Prints
    nothing unless `progress` (the sweep's own lines) or `verbose` (the libraries' too). A
    Ray this call started is shut down when it returns; one the caller started is not.
    """
    quiet(verbose)
    try:
        return _run_sweep(space, results_dir, tracking_uri, progress, callbacks, storage, study,
                          resume, overrides)  # fmt: skip
    finally:
        stop_ray()


def _run_sweep(
    space: Space | str | Path | None,
    results_dir: Path | None,
    tracking_uri: str | None,
    progress: bool,
    callbacks: list[tune.Callback] | None,
    storage: str | None,
    study: str | None,
    resume: str | None,
    overrides: dict[str, Any],
) -> SweepResult:
    if resume is not None:
        if space is not None or overrides:
            raise TypeError("resume continues a sweep as it was: pass no space or overrides")
        sweep = Sweep.resume(resume, results_dir=results_dir, tracking_uri=tracking_uri)
    elif space is None:
        raise TypeError("give a space (a path, a built-in name or a Space) or resume=SWEEP_ID")
    else:
        sweep = Sweep.prepare(space, results_dir=results_dir, tracking_uri=tracking_uri,
                              storage=storage, study=study, **overrides)  # fmt: skip
    return sweep.run(callbacks, progress)
