"""Live progress of a sweep on the terminal: trials done/running/failed and the best so far."""

from __future__ import annotations

import math

from ray import tune
from rich.console import Console

from sweeper.space import Space
from trainer.spec.events import TrialStatus


class ProgressCallback(tune.Callback):
    def __init__(self, space: Space):
        self.space = space
        self.metric = space.objective.primary.metric
        self.maximize = space.objective.primary.mode == "max"
        self.started = self.done = self.failed = 0
        self.best: float | None = None

    @property
    def console(self) -> Console:
        # Made on use: Tune pickles callbacks, and a Console holds a lock.
        return Console(stderr=True)

    def _line(self, text: str) -> None:
        running = self.started - self.done
        best = f"{self.best:,.1f}" if self.best is not None else "-"
        self.console.print(
            f"[dim][{self.done}/{self.space.search.trials} done, {running} running, {self.failed} failed, "
            f"best {self.metric} {best}][/dim] {text}"
        )

    def _better(self, value: float) -> bool:
        return self.best is None or (value > self.best if self.maximize else value < self.best)

    def on_trial_start(self, iteration, trials, trial, **info):
        self.started += 1
        self._line(f"started {trial.trial_id}")

    def on_trial_complete(self, iteration, trials, trial, **info):
        self.done += 1
        result = trial.last_result or {}
        status = result.get("trial_status")
        if status == TrialStatus.OK:
            value = result.get(self.metric)
            if value is not None and math.isfinite(value) and self._better(value):
                self.best = value
            self._line(
                f"[green]ok[/green] {trial.trial_id} {self.metric}={value:,.1f} ({result.get('hardware', '')}, fidelity {result.get('fidelity', '?')})"
            )
        elif status == TrialStatus.FAILED:
            self.failed += 1
            self._line(
                f"[red]{result.get('failure_class')}[/red] {trial.trial_id}: {str(result.get('failure_message', ''))[:120]}"
            )
        else:
            self._line(f"[yellow]stopped[/yellow] {trial.trial_id} (early stopping)")

    def on_trial_error(self, iteration, trials, trial, **info):
        self.done += 1
        self.failed += 1
        self._line(f"[red]crashed[/red] {trial.trial_id}")
