"""A sweep without Ray: its trials run one at a time on this host, driven as Tune drives them.

Where Ray cannot start (a host that allows no TCP socket, as the lent TPU v5e's) or is not
wanted (one TPU VM, no cluster), the sweep's own searcher and callbacks (tracking, progress,
finish) run its trials here: each trial's trainer is a child process that holds the host's
devices alone, reported to the searcher and the callbacks in the order Tune reports them.
What Tune would keep to resume, the trials with their points and states and the pickled
searcher, is kept in the sweep's folder before and after every trial; `sweeper resume`
reruns a trial that was cut off and runs none that ended.
"""

from __future__ import annotations

import contextlib
import os
import queue
import re
import secrets
import signal
import threading
import time
import traceback
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from ray import tune
from ray.tune.search import Searcher

from sweeper.execute.host import HOST_NODE
from sweeper.execute.trainable import TrialRuntime, run_point
from sweeper.record.trial import ERROR, PENDING, RUNNING, TERMINATED
from sweeper.search.searcher import SweepSearch
from sweeper.space.schema import Space
from trainer.trial.events import FailureClass
from trainer.trial.files import write_json
from trainer.trial.result import TrialResult

HOST_TRIALS = "host_trials.json"  # the trials, their points and states
HOST_SEARCHER = "host_searcher.pkl"  # the searcher, as Tune pickles it with its experiment
HEARTBEAT_S = 1.0  # how often callbacks hear of a trial that reports nothing (on_step_begin)
# One program at a time holds a TPU: a trial started just as the last one let go can find the
# chip still held (libtpu's lockfile). It is started again, this many times, this much later.
CHIP_BUSY = re.compile(r"libtpu.{0,40}lockfile|TPU is already in use|already in use by")
BUSY_RETRIES, BUSY_WAIT_S = 3, 5.0


@dataclass
class HostStorage:
    """Where a host trial's files are (its trainer log among them)."""

    trial_working_directory: str


@dataclass
class HostTrial:
    """A trial of a sweep run without Ray, as the sweep's callbacks read a Tune trial."""

    trial_id: str
    config: dict[str, Any]
    storage: HostStorage | None
    status: str = PENDING
    last_result: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"trial_id": self.trial_id, "config": self.config, "status": self.status,
                "last_result": self.last_result}  # fmt: skip


class Sweep(Protocol):
    """What the host runner reads of a sweep (`sweeper.sweep.lifecycle.Sweep` is one)."""

    searcher: SweepSearch | None

    @property
    def space(self) -> Space: ...

    @property
    def sweep_dir(self) -> Path: ...

    @property
    def experiment_path(self) -> str: ...

    @property
    def remeasure(self) -> int: ...


class HostRunner:
    """Runs a sweep's trials one at a time on this host, as Tune would: suggest, start, report,
    complete; the state a resume needs written around every trial."""

    def __init__(
        self,
        sweep: Sweep,
        runtime: TrialRuntime,
        callbacks: list[tune.Callback],
        recorded: dict[str, TrialResult],
    ):
        assert sweep.searcher is not None, "prepare() or resume() made the searcher"
        self.sweep, self.runtime, self.callbacks = sweep, runtime, callbacks
        self.searcher: SweepSearch = sweep.searcher
        self.recorded = recorded
        self.cancel = threading.Event()  # the first Ctrl-C: the running trial is cut off
        self.trials: list[HostTrial] = []
        self.iteration = 0

    @property
    def experiment(self) -> Path:
        return Path(self.sweep.experiment_path)

    # -- durable state ------------------------------------------------------------------

    def save(self) -> None:
        folder = self.sweep.sweep_dir
        self.searcher.save(str(folder / HOST_SEARCHER))
        write_json(folder / HOST_TRIALS, [t.to_json() for t in self.trials], indent=1)

    @staticmethod
    def has_searcher(sweep_dir: Path) -> bool:
        return (sweep_dir / HOST_SEARCHER).exists()

    @classmethod
    def restore_searcher(cls, sweep_dir: Path) -> SweepSearch:
        """The searcher as the sweep's driver last saved it."""
        searcher = SweepSearch.__new__(SweepSearch)
        searcher.restore(str(sweep_dir / HOST_SEARCHER))
        return searcher

    def restore(self) -> None:
        """The trials of an earlier driver of this sweep: ended ones as they ended, a trial it
        cut off (or had not started) pending, to run again with its point."""
        path = self.sweep.sweep_dir / HOST_TRIALS
        if not path.exists():
            return
        import json

        for saved in json.loads(path.read_text()):
            ended = saved["status"] in (TERMINATED, ERROR) and saved["trial_id"] in self.recorded
            self.trials.append(
                HostTrial(
                    saved["trial_id"],
                    saved["config"],
                    self._storage(saved["trial_id"]),
                    saved["status"] if ended else PENDING,
                    saved["last_result"] if ended else {},
                )
            )

    def _storage(self, trial_id: str) -> HostStorage:
        return HostStorage(str(self.experiment / f"trial_{trial_id}"))

    # -- the loop -----------------------------------------------------------------------

    def fit(self) -> list[HostTrial]:
        """Every trial of the sweep, then the experiment's end (the sweep's finish callback
        writes its results). A first Ctrl-C cuts off the running trial and starts no more;
        a second raises KeyboardInterrupt at once."""
        self.restore()
        space = self.sweep.space
        planned = space.search.trials + self.sweep.remeasure
        budget = space.search.time_budget_s
        deadline = time.monotonic() + budget if budget else None
        # As Tune's driver does: the progress line first says the sweep and how to resume it.
        self._each("setup", stop=None, num_samples=planned, total_num_samples=planned)
        with self._first_ctrl_c():
            while not self.cancel.is_set():
                trial = next((t for t in self.trials if t.status == PENDING), None)
                if trial is None:
                    if len(self.trials) >= planned or (deadline and time.monotonic() > deadline):
                        break
                    trial = self._suggest()
                    if trial is None:
                        break
                self._run(trial)  # saved as it starts: a resume runs it again if it is cut off
                self.save()
            # Within: a Ctrl-C is then told by the handler it left (as Tune's is).
            self._each("on_experiment_end", trials=self.trials)
        return self.trials

    def _suggest(self) -> HostTrial | None:
        trial_id = secrets.token_hex(4)
        config = self.searcher.suggest(trial_id)
        if config is None or config == Searcher.FINISHED or not isinstance(config, dict):
            return None  # with no trial running, the searcher waits on nothing: it has ended
        trial = HostTrial(trial_id, config, self._storage(trial_id))
        self.trials.append(trial)
        return trial

    def _each(self, hook: str, **kwargs: Any) -> None:
        for callback in self.callbacks:
            getattr(callback, hook)(**kwargs)

    def _run(self, trial: HostTrial) -> None:
        """One trial, as Tune reports it: started, each result (to the searcher, then the
        callbacks), completed or errored; cut off by a Ctrl-C, it is left unended (the
        experiment's end records it as killed, a resume runs it again)."""
        self.iteration += 1
        trial.status = RUNNING
        self._each("on_trial_start", iteration=self.iteration, trials=self.trials, trial=trial)
        self.save()
        for attempt in range(BUSY_RETRIES + 1):
            error = self._attempt(trial)
            if self.cancel.is_set():
                trial.status = TERMINATED  # as Tune leaves a trial it stopped
                return
            busy = CHIP_BUSY.search(str(trial.last_result.get("failure_message", "")))
            if error is None and busy and attempt < BUSY_RETRIES:
                time.sleep(BUSY_WAIT_S)  # the chip was not yet let go: start it again
                continue
            break
        if error is not None:
            trial.status = ERROR
            self.searcher.on_trial_complete(trial.trial_id, error=True)
            self._each("on_trial_error", iteration=self.iteration, trials=self.trials,
                       trial=trial)  # fmt: skip
            return
        trial.status = TERMINATED
        self.searcher.on_trial_complete(trial.trial_id, result=trial.last_result)
        self._each("on_trial_complete", iteration=self.iteration, trials=self.trials, trial=trial)

    def _attempt(self, trial: HostTrial) -> str | None:
        """Run the trial's point in a worker thread, its reports handed to the searcher and
        callbacks on this one (as Tune's driver does); the error of a trial that raised."""
        reports: queue.Queue[dict[str, Any]] = queue.Queue()
        failed: list[str] = []
        trial_dir = (
            Path(trial.storage.trial_working_directory) if trial.storage else self.experiment
        )

        def work() -> None:
            try:
                run_point(
                    trial.config,
                    space=self.sweep.space,
                    runtime=self.runtime,
                    recorded=self.recorded,
                    trial_id=trial.trial_id,
                    trial_dir=trial_dir,
                    report=reports.put,
                    node_id=f"{HOST_NODE}-{os.getpid()}",  # its core leases: this driver's
                    cancel=self.cancel,
                )
            except Exception:  # a fault of the engine, not of the point: the trial errored
                failed.append(traceback.format_exc())
                with contextlib.suppress(OSError):
                    trial_dir.mkdir(parents=True, exist_ok=True)
                    (trial_dir / "error.txt").write_text(failed[-1])

        worker = threading.Thread(target=work, name=f"trial-{trial.trial_id}", daemon=True)
        worker.start()
        try:
            while worker.is_alive() or not reports.empty():
                try:
                    result = reports.get(timeout=HEARTBEAT_S)
                except queue.Empty:
                    self._each("on_step_begin", iteration=self.iteration, trials=self.trials)
                    continue
                if self.cancel.is_set():
                    continue  # cut off: what it says now is its killing, not its result
                trial.last_result = result
                self.searcher.on_trial_result(trial.trial_id, result)
                self._each("on_trial_result", iteration=self.iteration, trials=self.trials,
                           trial=trial, result=result)  # fmt: skip
        finally:  # a second Ctrl-C: the trial's processes end with it
            if worker.is_alive():
                self.cancel.set()
                worker.join()
        if failed and not self.cancel.is_set():
            trial.last_result = TrialResult.failed(
                FailureClass.CRASHED, f"the engine failed running the trial: {failed[-1][-1500:]}"
            ).to_report(self.sweep.space.objective.metrics)
            return failed[-1]
        return None

    @contextlib.contextmanager
    def _first_ctrl_c(self) -> Iterator[None]:
        """A first Ctrl-C (SIGTERM reaches here as one) cuts off the running trial and starts
        no more; the handler it found is then put back, so a second one acts at once (Tune's
        own handling: `sweeper.sweep.callbacks.ctrl_c` reads what it leaves)."""
        try:
            found = signal.getsignal(signal.SIGINT)

            def first(signum: int, frame: Any) -> None:
                self.cancel.set()
                signal.signal(signal.SIGINT, found)

            signal.signal(signal.SIGINT, first)
        except ValueError:  # not the main thread: no handler
            yield
            return
        try:
            yield
        finally:
            if not self.cancel.is_set():
                signal.signal(signal.SIGINT, found)
