"""MLflow records of a sweep: one experiment per space, a parent run per sweep, a child run per trial.

All writes happen in the driver (a Tune callback), in batches; trial workers never touch
MLflow, so an embedded SQLite store has a single writer and a server sees few requests.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any

from mlflow.entities import Metric, Param, RunTag
from mlflow.tracking import MlflowClient
from ray import tune

from sweeper.search import OPTUNA_NUMBER_KEY
from sweeper.space import MEASURED_METRICS, Space, assemble

STEP_METRICS = ("loss", "aux_loss", "grad_norm", "step_time_s", "tokens_per_sec_per_chip_running")
FINAL_METRICS = (
    *MEASURED_METRICS,
    "hbm_per_device_gib",
    "compile_s",
    "final_loss",
    "convergence_delta",
    "convergence_relative_delta",
    "trial_wall_s",
    "trainer_wall_s",
    "est_step_time_s",
    "est_tokens_per_sec_per_chip",
    "est_mfu",
    "est_compute_s",
    "est_hbm_s",
    "est_ici_s",
    "arithmetic_intensity_ici",
    "train_s",
)
# Where a trial ran (Ray node ids of its processes, slice name, process count, JAX device kind).
LAYOUT_TAGS = ("hosts", "slice", "processes", "device_kind")
# MLflow's per-call limits for log_batch.
MAX_METRICS, MAX_PARAMS, MAX_TAGS = 1000, 100, 100


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            flat.update(flatten(value, name + "."))
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
    """Thin owner of MLflow ids and writes for one sweep."""

    def __init__(self, tracking_uri: str, space: Space, sweep_id: str, artifact_root: Path):
        self._client: MlflowClient | None = None
        self.tracking_uri = tracking_uri
        self.space, self.sweep_id = space, sweep_id
        experiment = self.client.get_experiment_by_name(space.name)
        if experiment is None:
            self.experiment_id = self.client.create_experiment(
                space.name, artifact_location=artifact_root.resolve().as_uri()
            )
        else:
            self.experiment_id = experiment.experiment_id
        self.parent_run_id: str | None = None

    @property
    def client(self) -> MlflowClient:
        if self._client is None:
            self._client = MlflowClient(tracking_uri=self.tracking_uri)
        return self._client

    def __getstate__(self) -> dict[str, Any]:
        # Tune pickles callbacks with the experiment state; the client holds locks.
        return {**self.__dict__, "_client": None}

    def start_sweep(self, space_text: str, tags: dict[str, str]) -> str:
        run = self.client.create_run(
            self.experiment_id,
            run_name=f"sweep-{self.sweep_id}",
            tags={"sweeper.sweep_id": self.sweep_id, "sweeper.kind": "sweep", **tags},
        )
        self.parent_run_id = run.info.run_id
        search = self.space.search.model_dump()
        params = {f"search.{k}": v for k, v in search.items() if k != "warm_start"}
        params.update(
            {
                "target": self.space.target,
                "fidelity": self.space.fidelity,
                "objective": ",".join(self.space.objective.metrics),
            }
        )
        self._batch(self.parent_run_id, params=params)
        self.client.log_text(self.parent_run_id, space_text, "space.yaml")
        return self.parent_run_id

    def start_trial(
        self, trial_id: str, point: dict[str, Any], optuna_number: int | None, tags: dict[str, str]
    ) -> str:
        run = self.client.create_run(
            self.experiment_id,
            run_name=f"trial-{optuna_number if optuna_number is not None else trial_id}",
            tags={
                "mlflow.parentRunId": self.parent_run_id,
                "sweeper.sweep_id": self.sweep_id,
                "sweeper.trial_id": trial_id,
                "sweeper.optuna_trial": str(optuna_number),
                "sweeper.kind": "trial",
                "status": "running",
                **tags,
            },
        )
        run_id = run.info.run_id
        params = {k: v for k, v in flatten(assemble(self.space, point)).items() if k not in point}
        params.update(point)  # sampled knobs under their own names
        numeric = {k: _number(v) for k, v in point.items()}
        self._batch(
            run_id, params=params, metrics={k: v for k, v in numeric.items() if v is not None}
        )
        return run_id

    def log_steps(self, run_id: str, results: list[dict[str, Any]]) -> None:
        metrics = []
        now = int(time.time() * 1000)
        for result in results:
            step = int(result.get("step", 0))
            for name in STEP_METRICS:
                value = _number(result.get(name))
                if value is not None:
                    metrics.append(Metric(name, value, now, step))
        for i in range(0, len(metrics), MAX_METRICS):
            self.client.log_batch(run_id, metrics=metrics[i : i + MAX_METRICS])

    def finish_trial(self, run_id: str, final: dict[str, Any]) -> None:
        status = final.get("trial_status", "failed")
        metrics = {name: _number(final.get(name)) for name in FINAL_METRICS}
        if "convergence_passed" in final:
            metrics["convergence_passed"] = float(bool(final["convergence_passed"]))
        tags = {
            "status": status,
            "failure_class": final.get("failure_class") or "",
            "fidelity": final.get("fidelity") or self.space.effective_fidelity,
            "bound": final.get("bound", ""),
            "backend": final.get("backend", ""),
            "hardware": final.get("hardware", ""),
            "target": self.space.target,
            "convergence": {True: "passed", False: "failed"}.get(
                final.get("convergence_passed"), "not checked"
            ),
            **{k: str(final.get(k) or "") for k in LAYOUT_TAGS},
        }
        self._batch(run_id, metrics={k: v for k, v in metrics.items() if v is not None}, tags=tags)
        if final.get("trial_config"):  # from the trial's result: the driver may not see its disk
            self.client.log_text(run_id, final["trial_config"], "trial.json")
        if final.get("effects"):
            self.client.log_dict(run_id, json.loads(final["effects"]), "knob_effects.json")
        if status == "failed":
            self.client.log_text(
                run_id,
                f"{final.get('failure_class')}: {final.get('failure_message', '')}\n\n{final.get('log_tail', '')}",
                "trainer_log_tail.txt",
            )
        self.client.set_terminated(
            run_id,
            {"ok": "FINISHED", "stopped": "KILLED", "killed": "KILLED"}.get(status, "FAILED"),
        )

    def finish_sweep(
        self,
        best: dict[str, Any] | None,
        counts: dict[str, int],
        status: str = "FINISHED",
        notes: list[str] | None = None,
    ) -> None:
        metrics = {f"trials_{k}": float(v) for k, v in counts.items()}
        if best:
            for name in self.space.objective.metrics:
                value = _number(best.get(name))
                if value is not None:
                    metrics[f"best_{name}"] = value
        self._batch(
            self.parent_run_id,
            metrics=metrics,
            tags={"best_trial": str(best.get("trial_id")) if best else ""},
        )
        if notes:
            self.client.log_text(self.parent_run_id, "\n".join(notes) + "\n", "notes.txt")
        self.client.set_terminated(self.parent_run_id, status)

    def _batch(
        self,
        run_id: str,
        params: dict[str, Any] | None = None,
        metrics: dict[str, float] | None = None,
        tags: dict[str, str] | None = None,
    ) -> None:
        now = int(time.time() * 1000)
        p = [Param(k, str(v)[:6000]) for k, v in (params or {}).items()]
        m = [Metric(k, v, now, 0) for k, v in (metrics or {}).items()]
        t = [RunTag(k, str(v)) for k, v in (tags or {}).items()]
        while p or m or t:
            self.client.log_batch(
                run_id, metrics=m[:MAX_METRICS], params=p[:MAX_PARAMS], tags=t[:MAX_TAGS]
            )
            p, m, t = p[MAX_PARAMS:], m[MAX_METRICS:], t[MAX_TAGS:]


class TrackingCallback(tune.Callback):
    """Feeds Tune's trial events to the Tracker and keeps one row per finished trial."""

    FLUSH_EVERY = 20

    def __init__(self, tracker: Tracker, id_map_path: Path):
        self.tracker = tracker
        self.id_map_path = id_map_path
        self.run_ids: dict[str, str] = (
            json.loads(id_map_path.read_text()) if id_map_path.exists() else {}
        )
        self.pending: dict[str, list[dict[str, Any]]] = {}
        self.rows: list[dict[str, Any]] = []
        self.finished: set[str] = set()

    def _point(self, trial) -> dict[str, Any]:
        return {k: v for k, v in trial.config.items() if k != OPTUNA_NUMBER_KEY}

    def on_trial_start(self, iteration, trials, trial, **info):
        if trial.trial_id in self.run_ids:  # resumed: reattach, do not duplicate
            return
        number = trial.config.get(OPTUNA_NUMBER_KEY)
        self.run_ids[trial.trial_id] = self.tracker.start_trial(
            trial.trial_id, self._point(trial), number, {}
        )
        self.id_map_path.write_text(json.dumps(self.run_ids, indent=1))

    def on_trial_result(self, iteration, trials, trial, result, **info):
        if result.get("trial_status") != "running":
            return
        pending = self.pending.setdefault(trial.trial_id, [])
        pending.append(result)
        if len(pending) >= self.FLUSH_EVERY:
            self._flush(trial.trial_id)

    def _flush(self, trial_id: str) -> None:
        results = self.pending.pop(trial_id, [])
        if results and trial_id in self.run_ids:
            self.tracker.log_steps(self.run_ids[trial_id], results)

    def _finish(self, trial, error: bool, ending: dict[str, Any] | None = None) -> None:
        self._flush(trial.trial_id)
        self.finished.add(trial.trial_id)
        final = {**(trial.last_result or {}), **(ending or {})}
        if final.get("trial_status") not in ("ok", "failed", "killed"):
            # The trainable never made its final report: stopped by the scheduler, or the worker died.
            final = {**final, "trial_status": "failed" if error else "stopped"}
            final["failure_class"] = "crashed" if error else ""
            final["failure_message"] = (
                "the trial's worker failed" if error else "stopped early by the scheduler"
            )
        run_id = self.run_ids.get(trial.trial_id)
        if run_id:
            self.tracker.finish_trial(run_id, final)
        row = {
            "trial_id": trial.trial_id,
            "optuna_trial": trial.config.get(OPTUNA_NUMBER_KEY),
            "mlflow_run_id": run_id,
            "status": final.get("trial_status"),
            "failure_class": final.get("failure_class") or "",
            "failure_message": (final.get("failure_message") or "")[:300],
            **{k: final.get(k) for k in FINAL_METRICS},
            "convergence_passed": final.get("convergence_passed"),
            "hardware": final.get("hardware", ""),
            "fidelity": final.get("fidelity", ""),
            **{k: final.get(k) for k in (*LAYOUT_TAGS, "cores", "pids", "started_at", "ended_at")},
            "effects": final.get("effects", ""),
            **{f"knob:{k}": v for k, v in self._point(trial).items()},
        }
        self.rows.append(row)

    def kill(self, trial) -> None:
        """A trial cut off by an interrupted sweep: KILLED in MLflow, a `killed` row."""
        if trial.trial_id in self.finished or trial.trial_id not in self.run_ids:
            return  # already recorded, or never started (no run, no row)
        self._finish(
            trial,
            error=False,
            ending={
                "trial_status": "killed",
                "failure_class": "",
                "failure_message": "the sweep was interrupted (Ctrl-C / SIGTERM) while it ran",
            },
        )

    def on_trial_complete(self, iteration, trials, trial, **info):
        self._finish(trial, error=False)

    def on_trial_error(self, iteration, trials, trial, **info):
        self._finish(trial, error=True)


def default_tracking_uri(results_dir: Path) -> str:
    return f"sqlite:///{(results_dir / 'mlflow.db').resolve()}"


def check_tracking_server(uri: str) -> None:
    """Fail early, with the fix, when a tracking server cannot be reached."""
    saved = {
        k: os.environ.get(k)
        for k in ("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "MLFLOW_HTTP_REQUEST_TIMEOUT")
    }
    os.environ.update(MLFLOW_HTTP_REQUEST_MAX_RETRIES="0", MLFLOW_HTTP_REQUEST_TIMEOUT="5")
    try:
        MlflowClient(tracking_uri=uri).search_experiments(max_results=1)
    except Exception as exc:
        raise ConnectionError(
            f"cannot reach the MLflow tracking store {uri!r} ({type(exc).__name__}: {str(exc)[:200]}); "
            "start the server, fix --tracking-uri / MLFLOW_TRACKING_URI, or omit it to use results/mlflow.db"
        ) from None
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
