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
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import optuna
import pandas as pd
import yaml
from optuna.trial import TrialState
from ray import tune
from ray.tune.schedulers import ASHAScheduler

from sweeper.answer.export import trial_config
from sweeper.answer.progress import ProgressCallback
from sweeper.answer.recover import result_of_run
from sweeper.execute import tune_state
from sweeper.execute.cluster import given_address, place, start_ray
from sweeper.execute.host import this_host
from sweeper.execute.placement import Placement
from sweeper.execute.trainable import TrialRuntime, run_trial
from sweeper.record.callback import TrackingCallback
from sweeper.record.lock import SweepLock
from sweeper.record.manifest import (
    ID_MAP,
    JOURNAL,
    MANIFEST,
    SPACE_AS_RUN,
    Ending,
    SweepManifest,
    default_results_dir,
    new_sweep_id,
    now,
    sweeper_command,
)
from sweeper.record.stores import open_stores
from sweeper.record.tracker import Tracker, check_tracking_server, default_tracking_uri
from sweeper.record.trial import SweepTrial
from sweeper.search import ladder
from sweeper.search.distributions import make_sampler
from sweeper.search.outcomes import check_study, close_open_trials, stored_result
from sweeper.search.searcher import SweepSearch
from sweeper.space.errors import SpaceError
from sweeper.space.load import load_space, space_overrides
from sweeper.space.points import counted
from sweeper.space.schema import Space
from sweeper.sweep import finish as finishing
from sweeper.sweep.callbacks import LIVE_CALLBACKS, FinishCallback, SweepCallbacks, watching_ctrl_c
from sweeper.sweep.host import HostRunner
from sweeper.sweep.prepare import (
    Executor,
    check_study_exists,
    checked,
    choose_executor,
    concurrency,
    local_path,
    with_trial_base,
)
from sweeper.sweep.result import ResultsUnwritable, SweepInterrupted, SweepResult, unfinished
from trainer.trial.config import TrialConfig
from trainer.trial.events import FailureClass
from trainer.trial.files import write_text
from trainer.trial.result import TrialResult

# A trial whose Ray worker or host died is retried this many times (a trial fault never is).
INFRA_RETRIES = 2
# Seconds between saves of Tune's experiment state (Tune's default: 10 s or more). A trial
# started within this window of a driver's death is unknown to a resume; its records are
# closed as killed and Tune runs another in its place.
TUNE_STATE_EVERY_S = "2"


def _new_manifest(
    space: Space,
    placement: Placement,
    results_dir: Path,
    tracking_uri: str | None,
    sweep_id: str | None,
    storage: str | None,
    study: str | None,
    inert_notes: list[str],
    executor: Executor,
) -> SweepManifest:
    """A new sweep's identity: the space as its trials run it, its study, its stores."""
    storage = storage or str(results_dir)
    sweep_id = sweep_id or new_sweep_id()
    return SweepManifest(
        sweep_id=sweep_id,
        space=with_trial_base(space, placement, storage),
        study_name=study or f"{space.name}-{sweep_id}",
        own_study=study is None,
        optuna_storage=f"sqlite:///{results_dir / 'optuna.db'}",
        tracking_uri=tracking_uri or default_tracking_uri(results_dir),
        experiment_id="",
        parent_run_id="",
        storage=storage,
        executor=executor,
        ray_address=given_address() or "",
        inert_notes=inert_notes,
        started_at=now(),
    )


@dataclass
class Sweep:
    """One sweep: its manifest (the space as run, its study, its records: what `resume`
    reattaches), where its trials run, and the live state of its driver."""

    manifest: SweepManifest
    results_dir: Path
    tracker: Tracker
    tracking: TrackingCallback
    placement: Placement
    concurrency: int
    lock: SweepLock  # held from prepare/resume to the end of this driver's part
    placement_notes: list[str] = field(default_factory=list)
    resumed: bool = False  # reattached by `resume`: the tuner restores Tune's experiment
    result: SweepResult | None = None  # set once, by finish()
    unwritable: ResultsUnwritable | None = None  # finish() could not write the results
    # Made by prepare (it opens the Optuna study); None once resumed, when Tune restores
    # its pickled searcher. Kept to close trials an interruption cut off.
    searcher: SweepSearch | None = None
    interrupted: bool = False
    watching_ctrl_c: bool = False  # run() tells a Ctrl-C between trials (watching_ctrl_c)

    # -- what the manifest holds ----------------------------------------------------------

    @property
    def space(self) -> Space:
        return self.manifest.space

    @property
    def sweep_id(self) -> str:
        return self.manifest.sweep_id

    @property
    def tracking_uri(self) -> str:
        return self.manifest.tracking_uri

    @property
    def study_name(self) -> str:
        return self.manifest.study_name

    @property
    def optuna_storage(self) -> str:
        return self.manifest.optuna_storage

    @property
    def storage(self) -> str:
        return self.manifest.storage

    @property
    def own_study(self) -> bool:
        """False when --study continues a study shared with other sweeps."""
        return self.manifest.own_study

    @property
    def inert_notes(self) -> list[str]:
        return self.manifest.inert_notes

    @property
    def executor(self) -> Executor:
        """ray: Ray Tune schedules the trials; host: they run one at a time here, no Ray."""
        return self.manifest.executor

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
        executor: str = "auto",
        **overrides: Any,
    ) -> Sweep:
        """Check the space, read the Ray cluster, open the sweep's records.

        `executor`: `ray` (Ray Tune schedules the trials), `host` (one at a time on this
        host, no Ray: sweeper/sweep/host.py), or `auto`: ray, unless this host cannot start
        Ray and the caller has none (its notes then say so).

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
        chosen, executor_notes = choose_executor(executor, space)
        if chosen == "ray":
            start_ray()
            space, placement, inert_notes, placement_notes = checked(space)
        else:
            if space.search.concurrency > 1:
                executor_notes.append(
                    f"search.concurrency {space.search.concurrency}: without Ray, one trial at a time"
                )
                one = space.search.model_copy(update={"concurrency": 1})
                space = space.model_copy(update={"search": one})
            space, placement, inert_notes, placement_notes = checked(space, [this_host(space)])
        placement_notes += executor_notes
        results_dir = Path(results_dir or default_results_dir()).resolve()
        results_dir.mkdir(parents=True, exist_ok=True)
        manifest = _new_manifest(space, placement, results_dir, tracking_uri, sweep_id, storage,
                                 study, inert_notes, chosen)  # fmt: skip
        sweep = cls._open(manifest, results_dir, placement, placement_notes)
        if screened is not None:
            ladder.write_screen(sweep.sweep_dir, screened, written)
        sweep.tracker.start_sweep(
            yaml.safe_dump(space.model_dump(mode="json"), sort_keys=False),
            {
                "target": str(space.target),
                "fidelity": space.effective_fidelity,
                "sampler": space.search.sampler,
                "backend": placement.backend,
                "placement": placement.description,
                "inert": "; ".join(inert_notes) or "none",
            },
        )
        sweep.searcher = sweep._searcher()  # the Optuna study, warm-start points enqueued
        sweep.write_manifest()
        return sweep

    @classmethod
    def _open(
        cls,
        manifest: SweepManifest,
        results_dir: Path,
        placement: Placement,
        placement_notes: list[str],
    ) -> Sweep:
        """A new sweep's stores reached (their schemas made, one sweep at a time), its study
        checked against the space, its folder and tracker made."""
        open_stores(results_dir, manifest.tracking_uri, manifest.optuna_storage)
        try:
            check_study(manifest.space, manifest.study_name, manifest.optuna_storage)
        except ValueError as exc:
            raise SpaceError(str(exc), field="--study") from None
        sweep_dir = results_dir / manifest.space.name / manifest.sweep_id
        sweep_dir.mkdir(parents=True, exist_ok=True)
        lock = SweepLock(sweep_dir, manifest.sweep_id)
        lock.acquire("sweeper run")
        tracker = Tracker(manifest.tracking_uri, manifest.space, manifest.sweep_id,
                          results_dir / "mlartifacts", sweep_dir / JOURNAL)  # fmt: skip
        return cls(
            manifest=manifest,
            results_dir=results_dir,
            tracker=tracker,
            tracking=TrackingCallback(tracker, sweep_dir / ID_MAP),
            placement=placement,
            concurrency=1
            if manifest.executor == "host"
            else concurrency(manifest.space, placement)[0],
            lock=lock,
            placement_notes=placement_notes,
        )

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
        lock = SweepLock(sweep_dir, manifest.sweep_id)
        lock.acquire("sweeper resume")  # before Ray starts: a second resume is refused at once
        try:
            return cls._reattach(manifest, results_dir, lock, tracking_uri)
        except BaseException:
            lock.release()
            raise

    @classmethod
    def _reattach(
        cls,
        manifest: SweepManifest,
        results_dir: Path,
        lock: SweepLock,
        tracking_uri: str | None,
    ) -> Sweep:
        sweep_dir = results_dir / manifest.space.name / manifest.sweep_id
        check_study_exists(
            manifest.study_name, manifest.optuna_storage, manifest.sweep_id, results_dir
        )
        if manifest.executor == "host":
            _, placement = place(manifest.space, [this_host(manifest.space)])
        else:
            start_ray()
            _, placement = place(manifest.space)
        manifest = manifest.model_copy(
            update={"tracking_uri": tracking_uri or manifest.tracking_uri}
        )
        check_tracking_server(manifest.tracking_uri)
        tracker = Tracker(manifest.tracking_uri, manifest.space, manifest.sweep_id,
                          results_dir / "mlartifacts", sweep_dir / JOURNAL,
                          parent_run_id=manifest.parent_run_id)  # fmt: skip
        tracker.tag(tracker.parent, {"resumed_at": now()})
        sweep = cls(
            manifest=manifest,
            results_dir=results_dir,
            tracker=tracker,
            tracking=TrackingCallback(tracker, sweep_dir / ID_MAP),
            placement=placement,
            concurrency=1
            if manifest.executor == "host"
            else concurrency(manifest.space, placement)[0],
            lock=lock,
            placement_notes=[
                f"placement: {placement.description}",
                f"resumed sweep {manifest.sweep_id}",
            ],
            resumed=True,
        )
        if manifest.executor == "host":
            # Saved as the first trial starts; a driver stopped before that left none, and a
            # searcher made anew over the sweep's study asks as the first would have.
            # Its study is read where the manifest says it is now (the folder may have moved).
            if HostRunner.has_searcher(sweep_dir):
                sweep.searcher = HostRunner.restore_searcher(sweep_dir)
                sweep.searcher.reopen(manifest.optuna_storage)
            else:
                sweep.searcher = sweep._searcher()
            return sweep
        sweep.tuner_path()  # refuse now, not at fit(), when Tune has nothing to restore
        sweep.check_tune_state()
        return sweep

    def check_tune_state(self) -> None:
        """Refuse to resume from Tune state that Tune could not read (it would start the
        experiment afresh and call the sweep complete with part of its trials), once a cut
        storage copy has been mended from Ray's staging copy where that is whole."""
        experiment = local_path(self.tuner_path())
        if experiment is None:
            return  # remote storage: Tune reads it
        mended = tune_state.mend(experiment)
        if mended:
            self.placement_notes.append(mended)
        lost = tune_state.problems(experiment)
        if not lost:
            return
        known = self.known_trials()
        if not known:
            return  # no trial has begun: Tune's fresh start runs them all, nothing is lost
        closed = self.close_leftovers()
        self.tracker.terminate(self.tracker.parent, "KILLED")  # the sweep did not end well
        raise SpaceError(
            f"sweep {self.sweep_id}: Tune's state could not be read ({'; '.join(lost)}) and "
            "Ray's own copy of it is gone. Resuming would start the experiment afresh, run other "
            "trials in place of those it cut off and call the sweep complete without them, so it "
            "is not resumed. What its records "
            f"hold ({counted(len(known), 'trial')}): "
            + "; ".join(line for line, _ in known)
            + (f". {'; '.join(closed)}" if closed else "")
            + f". To go on, {self._continue_study()}: points it measured are reused, not run "
            "again",
            file=str(experiment),
            field="sweeper resume",
        )

    def _continue_study(self) -> str:
        """The command that runs this sweep's space again, continuing its Optuna study in the
        same results folder (the space as it ran written beside its manifest for it)."""
        path = self.sweep_dir / SPACE_AS_RUN
        try:
            write_text(path, yaml.safe_dump(self.space.model_dump(mode="json"), sort_keys=False))
        except OSError:
            return f"run the space of sweep {self.sweep_id} with --study {self.study_name}"
        command = sweeper_command(
            "run", str(path), "--study", self.study_name, results_dir=self.results_dir
        )
        return f"`{command}` continues its Optuna study"

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
        self.manifest = self.manifest.model_copy(
            update={
                "experiment_id": self.tracker.experiment_id,
                "parent_run_id": self.tracker.parent_run_id or "",
                "ending": ending or Ending(),
            }
        )
        self.manifest.write(self.sweep_dir / MANIFEST)

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
        if self.executor == "host":
            raise TypeError(
                f"sweep {self.sweep_id} runs without Ray (executor host): it has no Tune Tuner; "
                "sweep.run() runs it"
            )
        os.environ.setdefault("TUNE_GLOBAL_CHECKPOINT_S", TUNE_STATE_EVERY_S)
        all_callbacks = self._callbacks(callbacks, progress)
        LIVE_CALLBACKS[self.sweep_id] = all_callbacks
        runtime = self._runtime()
        trainable = tune.with_resources(
            tune.with_parameters(
                run_trial, space=self.space, runtime=runtime, recorded=self.recorded_results()
            ),
            self.placement.trial_resources,
        )
        if self.resumed:
            # The restored RunConfig's callbacks are a SweepCallbacks of this sweep's id: they
            # reach the callbacks this process registered for it, not the first driver's.
            return tune.Tuner.restore(
                self.tuner_path(), trainable, resume_unfinished=True, resume_errored=False,
                restart_errored=False,
            )  # fmt: skip
        run_config = tune.RunConfig(
            name=self.experiment_name,
            storage_path=f"{self.storage}/ray",
            callbacks=[SweepCallbacks(self.sweep_id)],
            # A trial whose worker or host died is retried; a trial fault is a result, never raised.
            failure_config=tune.FailureConfig(max_failures=INFRA_RETRIES, fail_fast=False),
            verbose=0,
        )
        return tune.Tuner(trainable, tune_config=self._tune_config(), run_config=run_config)

    def _callbacks(
        self, callbacks: list[tune.Callback] | None, progress: bool
    ) -> list[tune.Callback]:
        """The sweep's own callbacks (tracking, finish, optional progress), then the caller's."""
        all_callbacks: list[tune.Callback] = [self.tracking, FinishCallback(self)]
        if progress:
            all_callbacks.append(ProgressCallback(self.space, self.sweep_id, str(self.sweep_dir),
                                                  given_address()))  # fmt: skip
        return all_callbacks + (callbacks or [])

    def _runtime(self) -> TrialRuntime:
        return TrialRuntime(placement=self.placement, timeout_s=self.space.search.trial_timeout_s)

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
        return {**self._ended_in_tracking(set(recorded)), **recorded}

    def _ended_in_tracking(self, known: set[str]) -> dict[str, TrialResult]:
        """Trials whose ending MLflow recorded though Optuna never heard it (the driver died
        between the two): their result as the run keeps it, so that they are not run again."""
        ended: dict[str, TrialResult] = {}
        store = self.tracker.store
        for tune_id, run_id in self.tracking.run_ids.items():
            if tune_id in known:
                continue
            try:
                run = store.read(self.tracker.resolve(run_id))
            except Exception:  # a run the store cannot give back: the trial reruns
                continue
            result = result_of_run(run)
            if result is not None:
                ended[tune_id] = result
        return ended

    # -- finish ---------------------------------------------------------------------------

    def finish(self, trials: Sequence[SweepTrial] | None = None) -> SweepResult:
        """Summary files, notes and the parent run, from Tune's trials (restored ones included).

        Runs once, when Tune's experiment ends (the sweep's own callback); later calls
        return that result.
        """
        if self.result is None and self.unwritable is None:
            try:
                self.result = finishing.finish(self, trials)
            except ResultsUnwritable as exc:  # raised to the caller once Tune has returned
                self.unwritable = exc
            finally:
                self.lock.release()
        if self.unwritable is not None:
            raise self.unwritable
        assert self.result is not None
        return self.result

    def write_report(self, frame: pd.DataFrame, notes: list[str]) -> Path:
        """The sweep's HTML report (sweeper/answer/report.py), beside summary.csv."""
        from sweeper.answer import report

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
        trainer --config FILE` reruns (sweeper/answer/export.py)."""
        cores = self.placement.cpus_per_trial or None
        config = trial_config(self.space, point, self.placement.num_devices, cores)
        return config.model_dump(mode="json", exclude_defaults=True)

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
        fit: Callable[[], Any]
        if self.executor == "host":
            runner = HostRunner(
                self, self._runtime(), self._callbacks(callbacks, progress),
                self.recorded_results(),
            )  # fmt: skip
            fit = runner.fit
        else:
            fit = self.tuner(callbacks, progress).fit
        try:
            with watching_ctrl_c(self):
                try:
                    fit()
                except KeyboardInterrupt:
                    raise
                except BaseException:  # a store gone or full: no run left RUNNING
                    self.abandon()
                    raise
            return self.finish()
        except KeyboardInterrupt:  # a second Ctrl-C / SIGTERM, even as Tune returns
            if self.result is not None and not self.result.interrupted:
                return self.result  # it came after the sweep had ended well: nothing to stop
            raise self.interrupted_now() from None

    def interrupted_now(self) -> SweepInterrupted:
        """A second Ctrl-C / SIGTERM: the sweep stopped at once, left resumable (its records
        closed by `stop_resumable` unless its interrupted ending was already written)."""
        running = [] if self.result is not None else self.stop_resumable()
        return SweepInterrupted(self.sweep_id, running)

    def stop_resumable(self) -> list[str]:
        """Close what a sweep stopped at once leaves open, so that `resume` continues it: the
        running trials' runs KILLED, their Optuna trials told FAIL as killed (a resume reruns
        each into a trial of its own), the manifest's ending `interrupted`. The trials that
        were running."""
        running = sorted(t for t in self.tracking.run_ids if t not in self.tracking.finished)
        with contextlib.suppress(Exception):
            if self.searcher is not None:
                self.searcher.fail_unfinished("killed: the sweep was interrupted")
            else:
                self.close_leftovers()
        self.abandon()
        with contextlib.suppress(Exception):
            note = (
                f"interrupted by a second Ctrl-C / SIGTERM while {counted(len(running), 'trial')} ran "
                f"({', '.join(running) or 'none'}): resuming the sweep continues it"
            )
            self.write_manifest(Ending(state="interrupted", ended_at=now(), notes=[note]))
        return running

    def abandon(self) -> None:
        """Close this sweep's runs KILLED when its experiment died with an error (best effort:
        a store that cannot take them keeps them in the journal, and `resume` replays it)."""
        with contextlib.suppress(Exception):
            self.tracker.close_leftovers()
        with contextlib.suppress(Exception):
            self.tracker.terminate(self.tracker.parent, "KILLED")
        self.lock.release()
