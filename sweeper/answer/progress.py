"""Live progress of a sweep on the terminal: trials done/running/failed and the best so far."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from ray import tune
from rich.console import Console
from rich.markup import escape

from sweeper.answer.fold import say
from sweeper.answer.streams import terminal
from sweeper.record.manifest import results_dir_of, sweeper_command
from sweeper.record.row import ranking_of
from sweeper.record.trial import RUNNING, SweepTrial
from sweeper.space.points import REMEASURE_KEY
from sweeper.space.schema import Space
from trainer.trial.events import TrialStatus
from trainer.trial.result import PHASE_KEY, TrialResult

# Seconds a running trial goes without a line before one says it is still at it.
HEARTBEAT_S = 30.0


class ProgressCallback(tune.Callback):
    """One line a sweep event, short enough for a terminal: trials done, running and failed,
    and the best by the rule the final table uses (the search's own trials that ended well;
    a point measured again is shown as such, never as another best)."""

    def __init__(self, space: Space, sweep_id: str = "", sweep_dir: str = "",
                 address: str | None = None):  # fmt: skip
        self.space = space
        self.sweep_id, self.sweep_dir = sweep_id, sweep_dir
        self.address = address  # the Ray cluster `--address` named: resume attaches there
        # The search's trials and, at run fidelity, the best points measured again.
        search = space.search
        self.again_planned = search.remeasure_count(space.effective_fidelity)
        self.planned = search.trials + self.again_planned
        self.metric = space.objective.primary.metric
        self.maximize = space.objective.primary.mode == "max"
        self.started = self.done = self.failed = 0
        self.best: float | None = None
        self.since: dict[str, float] = {}  # trial id -> when it started
        self.phase: dict[str, str] = {}  # trial id -> the phase last shown
        self.shown_at: dict[str, float] = {}  # trial id -> when a line last spoke of it
        self.where: dict[str, str] = {}  # trial id -> where it was, as last shown
        self.values: dict[str, float] = {}  # the search's trials that ended well -> objective
        self.again: dict[str, float] = {}  # the points measured again -> their second figure

    @property
    def console(self) -> Console:
        # Made on use: Tune pickles callbacks, and a Console holds a lock.
        return terminal(stderr=True)

    def setup(self, stop: Any = None, num_samples: Any = None, total_num_samples: Any = None,
              **info: Any) -> None:  # fmt: skip
        """The sweep's id first: what `sweeper resume` needs if this driver dies."""
        if not self.sweep_id:
            return
        objective = self.space.objective.primary
        trials = self.planned - self.again_planned
        again = (
            f", then the best {self.again_planned} measured again ({self.planned} runs in all)"
            if self.again_planned
            else ""
        )
        resume = sweeper_command("resume", self.sweep_id, results_dir=results_dir_of(self.sweep_dir),
                                 address=self.address)  # fmt: skip
        plural = "s" if trials != 1 else ""
        say(
            self.console,
            f"sweep {self.sweep_id}: {trials} trial{plural} of {self.space.name}{again}, best = "
            f"{objective.mode} {objective.metric}; results in {self.sweep_dir}; if stopped, "
            f"`{resume}`",
        )

    def _line(self, text: str, mark: str = "") -> None:
        """One event: the counts, `mark` (a word in colour, markup) and `text` (plain words),
        folded to the terminal's width."""
        running = self.started - self.done
        best = f"{self.best:,.1f}" if self.best is not None else "-"
        counts = f"[{self.done}/{self.planned} done, {running} running, {self.failed} failed, "
        say(self.console, text, f"[dim]{escape(counts)}best {best}][/dim] {mark}")

    def _ranking_figure(self, trial_id: str) -> float:
        """As the final table ranks (table.ranking_figure): a point measured again by the mean
        of its two figures."""
        return ranking_of(self.values[trial_id], self.again.get(trial_id))

    def _rank(self) -> None:
        figures = [self._ranking_figure(t) for t in self.values]
        self.best = (max if self.maximize else min)(figures) if figures else None

    def on_trial_start(
        self, iteration: int, trials: Sequence[SweepTrial], trial: SweepTrial, **info: Any
    ) -> None:
        self.started += 1
        self.since[trial.trial_id] = self.shown_at[trial.trial_id] = time.monotonic()
        again = trial.config.get(REMEASURE_KEY)
        said = f": {again} measured again" if again else ""
        self._line(f"started {trial.trial_id}{said}")

    def on_trial_result(
        self,
        iteration: int,
        trials: Sequence[SweepTrial],
        trial: SweepTrial,
        result: dict[str, Any],
        **info: Any,
    ) -> None:
        """A line when a running trial changes phase (compiling, training, finishing), and
        every HEARTBEAT_S while it stays in one: alive, and how long it has taken."""
        phase = result.get(PHASE_KEY)
        if not phase:
            return
        trial_id, now = trial.trial_id, time.monotonic()
        where = phase
        if "step" in result:
            where = f"step {int(result['step']) + 1} of {int(result.get('steps') or 0)}"
        if "tuned" in result:  # kernels.tune's compiles: how many of about how many
            where = f"tuning kernels: compile {int(result['tuned'])} of {int(result['tunes'])}"
        if phase == "finishing":
            where = "checking convergence" if self._checks else "finishing"
        changed = self.phase.get(trial_id) != phase
        self.where[trial_id] = where
        if changed or now - self.shown_at.get(trial_id, now) >= HEARTBEAT_S:
            self.phase[trial_id], self.shown_at[trial_id] = phase, now
            elapsed = now - self.since.get(trial_id, now)
            self._line(f"{trial_id} {where} ({elapsed:.0f} s)")

    def on_step_begin(self, iteration: int, trials: Sequence[SweepTrial], **info: Any) -> None:
        """A trial that reports nothing for long (a compile of minutes) is still said to be
        alive every HEARTBEAT_S, in the phase it last reported."""
        now = time.monotonic()
        for trial in trials:
            trial_id = trial.trial_id
            if trial.status != RUNNING or trial_id not in self.since:
                continue
            if now - self.shown_at.get(trial_id, now) >= HEARTBEAT_S:
                self.shown_at[trial_id] = now
                where = self.where.get(trial_id, "starting")
                self._line(f"{trial_id} {where} ({now - self.since[trial_id]:.0f} s)")

    @property
    def _checks(self) -> bool:
        # The trials' own setting: off for compile trials and for MaxText's (no reference).
        return bool(self.space.base_trial()["convergence"]["enabled"])

    def on_trial_complete(
        self, iteration: int, trials: Sequence[SweepTrial], trial: SweepTrial, **info: Any
    ) -> None:
        self.done += 1
        result = TrialResult.from_report(trial.last_result)
        again = trial.config.get(REMEASURE_KEY)
        if result is not None and result.ok:
            value = result.figure(self.metric)
            shown = "-" if value is None else f"{value:,.1f}"
            if again:  # the same point measured again: beside its first figure, never a best
                first = self.values.get(str(again))
                said = "" if first is None else f" (first {first:,.1f}"
                if first is not None and value is not None:
                    self.again[str(again)] = value
                    self._rank()
                    said += f"; it ranks by their mean, {ranking_of(first, value):,.1f}"
                said += ")" if said else ""
                self._line(f"{again}: {shown}{said} by {trial.trial_id}", "[green]again[/green] ")
                return
            if value is not None:
                self.values[trial.trial_id] = value
                self._rank()
            fidelity = result.fidelity.value if result.fidelity else "?"
            self._line(f"{trial.trial_id} {shown} ({fidelity} on {result.hardware})",
                       "[green]ok[/green] ")  # fmt: skip
        elif result is not None and result.status == TrialStatus.FAILED:
            self.failed += 1
            failure = result.failure_class.value if result.failure_class else ""
            said = result.failure_message[:120]
            self._line(f"{trial.trial_id}: {said}", f"[red]{failure}[/red] ")
        else:
            self._line(f"{trial.trial_id} (early stopping)", "[yellow]stopped[/yellow] ")

    def on_trial_error(
        self, iteration: int, trials: Sequence[SweepTrial], trial: SweepTrial, **info: Any
    ) -> None:
        self.done += 1
        self.failed += 1
        self._line(trial.trial_id, "[red]crashed[/red] ")
