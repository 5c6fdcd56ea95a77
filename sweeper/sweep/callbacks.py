"""What Tune calls back for a sweep: its hooks forwarded to the callbacks this process
registered for the sweep, the sweep finished when Tune's experiment ends, and Ctrl-C told
apart from a sweep that ended by itself."""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

from ray import tune

from sweeper.record.callback import TrackingCallback
from sweeper.record.trial import SweepTrial
from sweeper.search.searcher import SweepSearch
from sweeper.sweep.result import ResultsUnwritable, SweepResult
from trainer.trial.result import TrialResult


class Sweep(Protocol):
    """What Tune's experiment end and Ctrl-C touch of a sweep (`sweeper.sweep.Sweep` is one)."""

    tracking: TrackingCallback
    searcher: SweepSearch | None
    interrupted: bool
    watching_ctrl_c: bool

    def finish(self, trials: Sequence[SweepTrial] | None = None) -> SweepResult: ...


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

    def on_experiment_end(self, trials: Sequence[SweepTrial], **info: Any) -> None:
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
        self.sweep.interrupted = bool(cut or unstarted or ctrl_c(self.sweep))
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
def watching_ctrl_c(sweep: Sweep) -> Iterator[None]:
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


def ctrl_c(sweep: Sweep) -> bool:
    """Whether Tune's fit was stopped by Ctrl-C / SIGTERM (run() watching)."""
    return sweep.watching_ctrl_c and signal.getsignal(signal.SIGINT) is _sigint_marker


def _ended(trial: SweepTrial) -> bool:
    final = TrialResult.from_report(trial.last_result)
    return final is not None and final.ended
