"""What a sweep records, and when: one experiment per space, a parent run per sweep, a child
run per trial, kept in a tracking store (sweeper/stores.py: MLflow, or in memory).

All writes happen in the driver (a Tune callback), in batches; trial workers never touch
the store, so an embedded SQLite store has a single writer and a server sees few requests.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sweeper.record import mlflow_view
from sweeper.record.journal import TrackingJournal, is_outage
from sweeper.record.row import (
    LAYOUT_TAGS,
    RANKING,
    REMEASURED,
    STEP_METRICS,
    TUNING_FILE,
    TrialRow,
    final_metrics,
    missing,
    ranking_of,
    readable,
)
from sweeper.record.stores import PARENT, store_for
from sweeper.space.points import (
    KEY_SEPARATOR,
    assemble,
)
from sweeper.space.schema import Space
from trainer.trial.events import TrialStatus
from trainer.trial.result import TrialResult

if TYPE_CHECKING:
    import pandas as pd

log = logging.getLogger("sweeper")
# Bounded MLflow HTTP calls: an unreachable store costs seconds, then the journal takes over.
MLFLOW_REQUEST_BOUNDS = {
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "15",
}
# MLflow's per-call limits for log_batch.
MAX_METRICS, MAX_PARAMS, MAX_TAGS = 1000, 100, 100


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            flat.update(flatten(value, name + KEY_SEPARATOR))
        else:
            flat[name] = value
    return flat


def _number(value: Any) -> float | None:
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, int | float) and math.isfinite(value):
        return float(value)
    return None


class Tracker:
    """Owner of one sweep's run ids and writes, in the store `tracking_uri` names.

    Every write goes through `_write`: calls have bounded retries and timeouts, and while
    the store is unreachable writes go to the sweep's journal (sweeper/journal.py) and are
    replayed, in order, once it answers again. The sweep never waits on the store.
    """

    RETRY_EVERY_S = 10.0

    def __init__(
        self,
        tracking_uri: str,
        space: Space,
        sweep_id: str,
        artifact_root: Path,
        journal: Path,
        parent_run_id: str | None = None,
    ):
        bound_mlflow_requests()
        self.store = store_for(tracking_uri)
        self.tracking_uri = tracking_uri
        self.space, self.sweep_id = space, sweep_id
        self.journal = TrackingJournal(journal)
        self.outages: list[str] = []  # outages survived, for the sweep's notes
        self._down_since: float | None = None
        self._warned_where = ""
        self._last_try = 0.0
        self.experiment_id = self.store.experiment(space.name, artifact_root)
        self.parent_run_id = parent_run_id
        self._write("experiment_tags", tags=mlflow_view.experiment_tags(space))
        if len(self.journal):
            self._reconnect(force=True)

    @property
    def parent(self) -> str:
        """The sweep's run (its id as created: a local one while the store was down)."""
        if self.parent_run_id is None:
            raise RuntimeError("the sweep's run is not started: call start_sweep first")
        return self.parent_run_id

    def resolve(self, run_id: str) -> str:
        """The real MLflow id of a run (a run created during an outage has a local id first)."""
        return self.journal.resolve(run_id)

    def _apply(self, entry: dict[str, Any]) -> str | None:
        op, run_id = entry["op"], self.resolve(entry.get("run_id", ""))
        if op == "create_run":
            tags = {k: self.resolve(v) if k == PARENT else v for k, v in entry["tags"].items()}
            return self.store.create_run(self.experiment_id, entry["name"], tags)
        if op == "log_batch":
            self.store.log_batch(
                run_id,
                metrics=[tuple(m) for m in entry.get("metrics", [])],
                params=[tuple(p) for p in entry.get("params", [])],
                tags=[tuple(t) for t in entry.get("tags", [])],
            )
        elif op == "log_text":
            self.store.log_text(run_id, entry["text"], entry["path"])
        elif op == "set_terminated":
            self.store.set_terminated(run_id, entry["status"], entry["end_time"])
        elif op == "log_artifacts":
            self.store.log_artifacts(run_id, entry["local_dir"], entry["path"])
        elif op == "experiment_tags":
            self.store.set_experiment_tags(self.experiment_id, entry["tags"])
        return None

    def _create(self, name: str, tags: dict[str, str]) -> str:
        """A new run's id: the store's, or a local one kept in the journal during an outage."""
        run_id = self._write("create_run", name=name, tags=tags)
        assert run_id is not None, "a created run has an id"
        return run_id

    def _write(self, op: str, **args: Any) -> str | None:
        if len(self.journal) and not self._reconnect():
            return self._journaled(op, **args)
        try:
            return self._apply({"op": op, **args})
        except Exception as exc:
            if not is_outage(exc):
                raise
            self._went_away(exc)
            return self._journaled(op, **args)

    def _went_away(self, exc: BaseException) -> None:
        self._last_try = time.monotonic()
        if self._down_since is not None:
            return
        self._down_since = time.time()
        self._warned_where = self.journal.where
        log.warning(
            f"tracking store {self.tracking_uri} unreachable ({str(exc)[:160]}); the sweep goes "
            f"on, its records wait in {self.journal.where} and are replayed when the store "
            "answers (or by `sweeper resume`)"
        )

    def _journaled(self, op: str, **args: Any) -> str | None:
        """One write kept in the journal; said once if the journal's file cannot keep it."""
        local = self.journal.append(op, **args)
        if self.journal.unwritable and self._warned_where != self.journal.where:
            self._warned_where = self.journal.where
            log.warning(f"tracking records now wait in {self.journal.where}")
        return local

    def _reconnect(self, force: bool = False) -> bool:
        """Replay the journal when it is time to try; True once it is empty."""
        if not force and time.monotonic() - self._last_try < self.RETRY_EVERY_S:
            return False
        self._last_try = time.monotonic()
        waiting = len(self.journal)
        try:
            self.journal.replay(self._apply)
        except Exception as exc:
            if not is_outage(exc):
                raise
            self._went_away(exc)
            return False
        if self._down_since is not None:
            down = time.time() - self._down_since
            self.outages.append(
                f"tracking store was down about {down:.0f} s: {waiting} records journaled in "
                f"{self.journal.path.name} meanwhile, all replayed"
            )
            log.warning(f"tracking store back: {waiting} journaled records replayed")
            self._down_since = None
        return True

    def flush(self) -> int:
        """Last replay attempt; the number of records still waiting in the journal."""
        if len(self.journal):
            self._reconnect(force=True)
        return len(self.journal)

    def start_sweep(self, space_text: str, tags: dict[str, str]) -> str:
        self.parent_run_id = self._create(
            f"sweep-{self.sweep_id}",
            {"sweeper.sweep_id": self.sweep_id, "sweeper.kind": "sweep", **tags},
        )
        search = self.space.search.model_dump()
        params = {f"search.{k}": v for k, v in search.items() if k != "warm_start"}
        params.update(
            {
                "target": str(self.space.target),
                "fidelity": self.space.fidelity,
                "objective": ",".join(self.space.objective.metrics),
            }
        )
        self._batch(self.parent, params=params)
        self._write("log_text", run_id=self.parent, text=space_text, path="space.yaml")
        self.show_sweep()
        return self.parent

    def show_sweep(self) -> None:
        """The sweep's shared view in the MLflow UI (its runs, sorted, its columns, charts)."""
        view = mlflow_view.view_tag(self.space, self.sweep_id, self.resolve(self.parent))
        self._write("experiment_tags", tags=view)

    def runs_url(self, base: str) -> str:
        return mlflow_view.runs_url(base, self.experiment_id, self.sweep_id)

    def start_trial(
        self, trial_id: str, point: dict[str, Any], optuna_number: int | None, tags: dict[str, str]
    ) -> str:
        run_id = self._create(
            mlflow_view.run_name(trial_id, point, mlflow_view.varied_knobs(self.space)),
            {
                PARENT: self.parent,
                "sweeper.sweep_id": self.sweep_id,
                "sweeper.trial_id": trial_id,
                "sweeper.optuna_trial": str(optuna_number),
                "sweeper.kind": "trial",
                "status": TrialStatus.RUNNING,
                **tags,
            },
        )
        # Sampled knobs under one prefix, the rest of the trial's configuration under another:
        # as params only (a knob as a metric would take the UI's first chart).
        fixed = {k: v for k, v in flatten(assemble(self.space, point)).items() if k not in point}
        params = {
            **{f"{mlflow_view.KNOB_PARAM}{k}": v for k, v in point.items()},
            **{f"{mlflow_view.TRIAL_PARAM}{k}": v for k, v in fixed.items()},
        }
        self._batch(run_id, params=params)
        return run_id

    def tag(self, run_id: str, tags: dict[str, str]) -> None:
        self._batch(run_id, tags=tags)

    def log_steps(self, run_id: str, results: list[dict[str, Any]]) -> None:
        metrics = []
        now = int(time.time() * 1000)
        for result in results:
            step = int(result.get("step", 0))
            for name in STEP_METRICS:
                value = _number(result.get(name))
                if value is not None:
                    metrics.append((name, value, now, step))
        for i in range(0, len(metrics), MAX_METRICS):
            self._write("log_batch", run_id=run_id, metrics=metrics[i : i + MAX_METRICS])

    def finish_trial(self, run_id: str, final: TrialResult) -> None:
        metrics = final_metrics(final)
        if final.convergence is not None:
            metrics["convergence_passed"] = float(final.convergence.passed)
        verdict = final.convergence.passed if final.convergence else None
        tags: dict[str, str] = {
            "status": final.status.value,
            "failure_class": final.failure_class.value if final.failure_class else "",
            "fidelity": final.fidelity.value if final.fidelity else self.space.effective_fidelity,
            "bound": final.bound,
            "backend": final.backend,
            "hardware": final.hardware,
            "program": final.program or self.space.program,
            "target": str(self.space.target),
            "convergence": "not checked"
            if verdict is None
            else ("passed" if verdict else "failed"),
            **{k: str(getattr(final.layout, k) or "") for k in LAYOUT_TAGS},
            "started_at": readable(final.layout.started_at),
            "ended_at": readable(final.layout.ended_at),
        }
        if final.reused_from is not None:
            tags["reused_from"] = f"optuna trial {final.reused_from}"
        primary = self.space.objective.primary.metric
        if self._ranks() and final.ok and final.figure(primary) is not None:
            metrics[f"{RANKING}{primary}"] = final.figure(primary)
        # The tiles kernels.tune chose, as the run's settings (`tuned.block_q`,
        # `tuned.tokamax_tiles.wi_fwd`, ...).
        chosen = (final.kernel_tuning or {}).get("settings") or {}
        tuned = {f"{mlflow_view.TUNED_PARAM}{k}": v for k, v in chosen.items()}
        self._batch(
            run_id,
            params=tuned,
            metrics={k: v for k, v in metrics.items() if v is not None},
            tags=tags,
        )
        if final.trial_config:  # from the trial's result: the driver may not see its disk
            self._write("log_text", run_id=run_id, text=final.trial_config, path="trial.json")
        if final.kernel_tuning:  # every candidate kernels.tune tried, as the trial's folder has it
            text = json.dumps(final.kernel_tuning, indent=1)
            self._write("log_text", run_id=run_id, text=text, path=TUNING_FILE)
        self._log_profile(run_id, final)
        if final.effects:
            text = json.dumps(
                {k: e.model_dump(mode="json") for k, e in final.effects.items()}, indent=1
            )
            self._write("log_text", run_id=run_id, text=text, path="knob_effects.json")
        if final.status == TrialStatus.FAILED:
            failure = final.failure_class.value if final.failure_class else None
            self._write(
                "log_text",
                run_id=run_id,
                text=f"{failure}: {final.failure_message}\n\n{final.log_tail}",
                path="trainer_log_tail.txt",
            )
        self.terminate(run_id, RUN_STATUS.get(final.status, "FAILED"))

    def _ranks(self) -> bool:
        """Whether this sweep measures points again: its runs then carry `ranking_<metric>`."""
        return self.space.search.remeasure_count(self.space.effective_fidelity) > 0

    def log_remeasure(
        self, run_id: str, by: str, final: TrialResult, first: TrialResult | None = None
    ) -> None:
        """A second measurement of a trial's point, on that trial's run: `remeasured_<figure>`
        for its objective and interval, who measured it (`remeasured_by`, `remeasured`) and,
        with the `first` measurement, the mean of both that it ranks by (`ranking_<metric>`)."""
        names = [*self.space.objective.metrics]
        names += [f"{m}{end}" for m in names for end in ("_low", "_high")]
        metrics = {f"{REMEASURED}{n}": v for n in names if (v := final.figure(n)) is not None}
        primary = self.space.objective.primary.metric
        once, again = (first.figure(primary) if first else None), final.figure(primary)
        if once is not None and again is not None:
            metrics[f"{RANKING}{primary}"] = ranking_of(once, again)
        failure = final.failure_class.value if final.failure_class else ""
        tags = {
            f"{REMEASURED}by": by,
            "remeasured": final.status.value + (f": {failure}" if failure else ""),
        }
        self._batch(run_id, metrics=metrics, tags=tags)
        self._log_profile(run_id, final)  # the best point's trace, on its trial's run

    def _log_profile(self, run_id: str, final: TrialResult) -> None:
        """A trial's profiler trace as the run's `profile/` artifacts, where this host sees it."""
        if final.profile_dir and Path(final.profile_dir).is_dir():
            self._write("log_artifacts", run_id=run_id, local_dir=final.profile_dir, path="profile")

    def terminate(self, run_id: str, status: str) -> None:
        self._write(
            "set_terminated", run_id=run_id, status=status, end_time=int(time.time() * 1000)
        )

    def finish_sweep(
        self,
        best: TrialRow | None,
        counts: dict[str, int],
        status: str = "FINISHED",
        notes: list[str] | None = None,
    ) -> None:
        metrics = {f"trials_{k}": float(v) for k, v in counts.items()}
        if best:  # the figures it ranks by (a point measured again: the mean of both)
            for name in self.space.objective.metrics:
                value = best.ranking_figure(name)
                if value is not None:
                    metrics[f"best_{name}"] = value
        self._batch(
            self.parent,
            metrics=metrics,
            tags={
                "best_trial": best.trial_id if best else "",
                mlflow_view.NOTE: self.description(best, counts, notes or []),
            },
        )
        if notes:
            self._write(
                "log_text",
                run_id=self.parent,
                text="\n".join(notes) + "\n",
                path="notes.txt",
            )
        self.terminate(self.parent, status)

    def description(self, best: TrialRow | None, counts: dict[str, int], notes: list[str]) -> str:
        """The sweep run's description in the UI: its best trial, its counts, its notes."""
        metric = self.space.objective.primary.metric
        if best:
            value = best.ranking_figure(metric)
            shown = "-" if value is None else f"{value:,.1f}"
            first, again = best.figure(metric), best.figure(f"{REMEASURED}{metric}")
            if first is not None and again is not None:
                shown += f" (the mean of {first:,.1f} and, measured again, {again:,.1f})"
            fidelity = best.fidelity.value if best.fidelity else "?"
            head = (
                f"Best: trial {best.trial_id}, {metric} {shown} (fidelity "
                f"{fidelity}, on {best.hardware or '?'})."
            )
        else:
            head = "No trial ended well."
        tally = ", ".join(f"{v} {k}" for k, v in counts.items())
        return "\n\n".join([head, f"Trials: {tally}.", *(f"- {n}" for n in notes)])

    def log_ladder(self, frame: pd.DataFrame, table: Path, figures: dict[str, float]) -> None:
        """The ladder's rungs: each trial's screen verdict and ranks as tags of its run, the
        rank correlation and counts on the sweep's run, ladder.csv as its artifact."""
        for _, row in frame.iterrows():
            run_id = row.get("mlflow_run_id")
            if not isinstance(run_id, str) or not run_id:
                continue
            tags = {
                f"ladder.{name}": "" if missing(row.get(name)) else str(row.get(name))
                for name in ("screen_verdict", "screen_rank", "screen_compiled_for", "verify_rank")
            }
            self.tag(run_id, tags)
        self._batch(self.parent, metrics=figures, tags={})
        self._write("log_text", run_id=self.parent, text=table.read_text(), path=table.name)

    def log_report(self, path: Path) -> None:
        """The sweep's HTML report, as an artifact of its run."""
        self._write("log_text", run_id=self.parent, text=path.read_text(), path=path.name)

    def close_leftovers(self) -> int:
        """KILLED for this sweep's child runs still RUNNING once its trials have all ended.

        A driver killed mid-sweep leaves them; `sweeper resume` closes them.
        """
        running = self.store.search(
            self.experiment_id, {"sweeper.sweep_id": self.sweep_id}, status="RUNNING"
        )
        closed = 0
        for run_id in running:
            if run_id == self.parent_run_id:
                continue
            self.tag(run_id, {"status": TrialStatus.KILLED})
            self.terminate(run_id, "KILLED")
            closed += 1
        return closed

    def _batch(
        self,
        run_id: str,
        params: dict[str, Any] | None = None,
        metrics: dict[str, float] | None = None,
        tags: dict[str, str] | None = None,
    ) -> None:
        now = int(time.time() * 1000)
        p = [(k, str(v)[:6000]) for k, v in (params or {}).items()]
        m = [(k, v, now, 0) for k, v in (metrics or {}).items()]
        t = [(k, str(v)) for k, v in (tags or {}).items()]
        while p or m or t:
            self._write("log_batch", run_id=run_id, metrics=m[:MAX_METRICS],
                        params=p[:MAX_PARAMS], tags=t[:MAX_TAGS])  # fmt: skip
            p, m, t = p[MAX_PARAMS:], m[MAX_METRICS:], t[MAX_TAGS:]


RUN_STATUS = {
    TrialStatus.OK: "FINISHED",
    TrialStatus.STOPPED: "KILLED",
    TrialStatus.KILLED: "KILLED",
}


def bound_mlflow_requests() -> None:
    """MLflow's defaults wait minutes on a dead server (7 retries, 120 s each): bound them.

    A value the user set in the environment wins.
    """
    for key, value in {
        **MLFLOW_REQUEST_BOUNDS,
        "MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT": "true",
        # Reading a run's artifacts back (a table rebuilt from MLflow) draws no progress bars.
        "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR": "false",
    }.items():
        os.environ.setdefault(key, value)


def default_tracking_uri(results_dir: Path) -> str:
    return f"sqlite:///{(results_dir / 'mlflow.db').resolve()}"


def check_tracking_server(uri: str) -> None:
    """Fail early, with the fix, when the tracking store cannot be reached."""
    store_for(uri).check()
