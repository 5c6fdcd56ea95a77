"""Tune's trial events, fed to the sweep's Tracker: one run per trial (reattached when Tune
retries a trial or a sweep is resumed), its steps in batches, its ending, and the trial ->
run map kept on disk."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ray import tune

from sweeper.record.journal import read_state
from sweeper.record.row import LOG_TAIL_LINES, TRAINER_LOG
from sweeper.record.tracker import Tracker
from sweeper.record.trial import SweepTrial
from sweeper.space.points import OPTUNA_NUMBER_KEY, REMEASURE_KEY, knob_point
from trainer.trial.events import FailureClass, TrialStatus
from trainer.trial.files import write_json
from trainer.trial.result import STATUS_KEY, TrialResult


class TrackingCallback(tune.Callback):
    """Feeds Tune's trial events to the Tracker and keeps each finished trial's final result.

    The trial -> MLflow run map and each trial's attempts live on disk (`id_map_path`), so
    a resumed sweep, or a trial Tune retries, reattaches to its run instead of duplicating it.
    """

    FLUSH_EVERY = 20

    def __init__(self, tracker: Tracker, id_map_path: Path):
        self.tracker = tracker
        self.id_map_path = id_map_path
        self.run_ids: dict[str, str] = {}
        self.attempts: dict[str, int] = {}
        self.repeats: dict[str, str] = {}  # re-measuring trial -> the trial whose point it repeats
        self.load()
        self.pending: dict[str, list[dict[str, Any]]] = {}
        self.finals: dict[str, TrialResult] = {}  # trial id -> what was recorded, this process
        self.seen: dict[str, Any] = {}  # trial id -> Tune trial, for trials that started here

    @property
    def finished(self) -> set[str]:
        return set(self.finals)

    def load(self) -> None:
        state = read_state(
            self.id_map_path,
            ("runs", "attempts"),
            "it maps trials to their MLflow runs: move it aside to go on (trials rerun then get "
            "new MLflow runs; summary.csv, Optuna and Tune keep every result)",
        )
        if state:
            self.run_ids, self.attempts = state["runs"], state["attempts"]
            self.repeats = state.get("repeats", {})

    def save(self) -> None:
        runs = {k: self.tracker.resolve(v) for k, v in self.run_ids.items()}
        state = {"runs": runs, "attempts": self.attempts, "repeats": self.repeats}
        write_json(self.id_map_path, state, indent=1)

    def on_trial_start(
        self, iteration: int, trials: Sequence[SweepTrial], trial: SweepTrial, **info: Any
    ) -> None:
        self.seen[trial.trial_id] = trial
        self.attempts[trial.trial_id] = self.attempts.get(trial.trial_id, 0) + 1
        if trial.config.get(REMEASURE_KEY):
            # A second measurement of an ended trial's point: recorded on that trial's run
            # when it ends (never a run, a row or a trial of its own in MLflow's table).
            self.repeats[trial.trial_id] = str(trial.config[REMEASURE_KEY])
        elif trial.trial_id in self.run_ids:  # retried or resumed: reattach, do not duplicate
            self.tracker.tag(
                self.run_ids[trial.trial_id],
                {"attempts": str(self.attempts[trial.trial_id]), "status": TrialStatus.RUNNING},
            )
        else:
            number = trial.config.get(OPTUNA_NUMBER_KEY)
            self.run_ids[trial.trial_id] = self.tracker.start_trial(
                trial.trial_id, knob_point(trial.config), number, {}
            )
        self.save()

    def on_trial_recover(
        self, iteration: int, trials: Sequence[SweepTrial], trial: SweepTrial, **info: Any
    ) -> None:
        self._flush(trial.trial_id)  # Tune retries it after an infrastructure fault

    def on_trial_result(
        self,
        iteration: int,
        trials: Sequence[SweepTrial],
        trial: SweepTrial,
        result: dict[str, Any],
        **info: Any,
    ) -> None:
        if result.get(STATUS_KEY) != TrialStatus.RUNNING:
            return
        pending = self.pending.setdefault(trial.trial_id, [])
        pending.append(result)
        if len(pending) >= self.FLUSH_EVERY:
            self._flush(trial.trial_id)

    def _flush(self, trial_id: str) -> None:
        results = self.pending.pop(trial_id, [])
        if results and trial_id in self.run_ids:
            self.tracker.log_steps(self.run_ids[trial_id], results)

    def _finish(self, trial: SweepTrial, error: bool, ending: TrialResult | None = None) -> None:
        self._flush(trial.trial_id)
        final = final_of(trial, error, ending)
        self.finals[trial.trial_id] = final
        original = self.repeats.get(trial.trial_id)
        if original is not None:
            run_of_original = self.run_ids.get(original)
            if run_of_original:
                first = self.finals.get(original)
                self.tracker.log_remeasure(run_of_original, trial.trial_id, final, first)
            return
        run_id = self.run_ids.get(trial.trial_id)
        if run_id:
            self.tracker.finish_trial(run_id, final)

    def kill(self, trial: SweepTrial) -> None:
        """A trial cut off by an interrupted sweep: KILLED in MLflow, a `killed` row."""
        if trial.trial_id in self.finals or trial.trial_id not in self.run_ids:
            return  # already recorded, or never started (no run, no row)
        message = "the sweep was interrupted (Ctrl-C / SIGTERM) while it ran"
        ending = TrialResult(
            status=TrialStatus.KILLED, failure_message=message, log_tail=log_tail(trial)
        )
        self._finish(trial, error=False, ending=ending)

    def run_id(self, trial_id: str) -> str | None:
        """The MLflow run of a trial (its server id once a journaled run was replayed)."""
        run_id = self.run_ids.get(trial_id)
        return self.tracker.resolve(run_id) if run_id else None

    def on_trial_complete(
        self, iteration: int, trials: Sequence[SweepTrial], trial: SweepTrial, **info: Any
    ) -> None:
        self._finish(trial, error=False)

    def on_trial_error(
        self, iteration: int, trials: Sequence[SweepTrial], trial: SweepTrial, **info: Any
    ) -> None:
        self._finish(trial, error=True)


def final_of(trial: SweepTrial, error: bool, ending: TrialResult | None = None) -> TrialResult:
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


def log_tail(trial: SweepTrial, lines: int = LOG_TAIL_LINES) -> str:
    """The end of a trial's trainer log, where this host can read it (a local trial's Tune
    working directory); empty otherwise."""
    if trial.storage is None:
        return ""
    path = Path(trial.storage.trial_working_directory) / TRAINER_LOG
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""
