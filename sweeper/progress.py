"""Live progress of a sweep on the terminal: trials done/running/failed and the best so far."""

from __future__ import annotations

from typing import Any

from ray import tune
from ray.tune.experiment import Trial
from rich.console import Console

from sweeper.space import Space
from trainer.spec.events import TrialStatus
from trainer.spec.result import TrialResult


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

    def on_trial_start(
        self, iteration: int, trials: list[Trial], trial: Trial, **info: Any
    ) -> None:
        self.started += 1
        self._line(f"started {trial.trial_id}")

    def on_trial_complete(
        self, iteration: int, trials: list[Trial], trial: Trial, **info: Any
    ) -> None:
        self.done += 1
        result = TrialResult.from_report(trial.last_result)
        if result is not None and result.ok:
            value = result.figure(self.metric)
            if value is not None and self._better(value):
                self.best = value
            shown = "-" if value is None else f"{value:,.1f}"
            fidelity = result.fidelity.value if result.fidelity else "?"
            self._line(
                f"[green]ok[/green] {trial.trial_id} {self.metric}={shown} ({result.hardware}, fidelity {fidelity})"
            )
        elif result is not None and result.status == TrialStatus.FAILED:
            self.failed += 1
            failure = result.failure_class.value if result.failure_class else ""
            self._line(f"[red]{failure}[/red] {trial.trial_id}: {result.failure_message[:120]}")
        else:
            self._line(f"[yellow]stopped[/yellow] {trial.trial_id} (early stopping)")

    def on_trial_error(
        self, iteration: int, trials: list[Trial], trial: Trial, **info: Any
    ) -> None:
        self.done += 1
        self.failed += 1
        self._line(f"[red]crashed[/red] {trial.trial_id}")
