"""Where a sweep's records are kept: MLflow (a server or a SQLite file), or this process's memory.

The Tracker (sweeper/tracking.py) owns what a sweep records and when; a store only keeps
runs. Both stores answer the same few calls, and tests/test_record_stores.py runs one
suite over both. `store_for(uri)` picks one: `memory:` or `memory:NAME` keeps the records
in this process (a pipeline that tracks elsewhere, or a test that reads them back; gone at
exit); anything else is an MLflow tracking URI.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from mlflow.entities import Metric, Param, RunTag
from mlflow.tracking import MlflowClient

MEMORY_SCHEME = "memory:"
TERMINAL = ("FINISHED", "FAILED", "KILLED")
PARENT = "mlflow.parentRunId"  # the tag that nests a trial's run under its sweep's (MLflow UI)

# (name, value, timestamp ms, step), (key, value), (key, value): MLflow's own batch shapes.
MetricRow = tuple[str, float, int, int]
Pair = tuple[str, str]


@dataclass
class RunRecord:
    """A run as the store keeps it."""

    run_id: str
    name: str
    status: str  # RUNNING, FINISHED, FAILED or KILLED
    tags: dict[str, str] = field(default_factory=dict)
    params: dict[str, str] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)  # the latest value of each
    history: dict[str, list[tuple[int, float]]] = field(default_factory=dict)  # (step, value)
    texts: dict[str, str] = field(default_factory=dict)  # artifact path -> text
    files: list[str] = field(default_factory=list)  # artifact paths of logged files
    end_time: int | None = None


class TrackingStore(Protocol):
    """The calls the Tracker makes. A store that cannot be reached raises an error
    `sweeper.journal.is_outage` recognises; the Tracker then journals the write."""

    uri: str

    def check(self) -> None:
        """Raise ConnectionError, naming the fix, when the store cannot be reached."""

    def experiment(self, name: str, artifact_root: Path) -> str:
        """The id of experiment `name`, created when missing."""

    def set_experiment_tags(self, experiment_id: str, tags: dict[str, str]) -> None: ...

    def experiment_tags(self, experiment_id: str) -> dict[str, str]: ...

    def create_run(self, experiment_id: str, name: str, tags: dict[str, str]) -> str: ...

    def log_batch(
        self, run_id: str, metrics: list[MetricRow], params: list[Pair], tags: list[Pair]
    ) -> None: ...

    def log_text(self, run_id: str, text: str, path: str) -> None: ...

    def log_artifacts(self, run_id: str, local_dir: str, path: str) -> None:
        """Every file under `local_dir`, as artifacts under `path`."""

    def set_terminated(self, run_id: str, status: str, end_time: int) -> None: ...

    def search(
        self, experiment_id: str, tags: dict[str, str], status: str | None = None
    ) -> list[str]:
        """Ids of the experiment's runs carrying all `tags` (and in `status`), oldest first."""

    def read(self, run_id: str) -> RunRecord: ...


def relocate_artifacts(uri: str, old: str, new: str) -> None:
    """In MLflow's SQLite store `uri`, every experiment's and run's artifact folder under the
    folder URI `old` read under `new` instead."""
    from mlflow.store.tracking.dbmodels.models import SqlExperiment, SqlRun
    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

    store = SqlAlchemyStore(uri, new)
    with store.ManagedSessionMaker(read_only=False) as session:
        for row, column in [*((e, "artifact_location") for e in session.query(SqlExperiment)),
                            *((r, "artifact_uri") for r in session.query(SqlRun))]:  # fmt: skip
            value = getattr(row, column) or ""
            if value == old or value.startswith(old + "/"):
                setattr(row, column, new + value[len(old) :])


class MlflowStore:
    """An MLflow tracking store: a server (`http(s)://`, artifacts in its own store) or a
    SQLite file (artifacts next to it, under the results folder)."""

    def __init__(self, uri: str):
        self.uri = uri
        self._client: MlflowClient | None = None

    @property
    def client(self) -> MlflowClient:
        if self._client is None:
            self._client = MlflowClient(tracking_uri=self.uri)
        return self._client

    def __getstate__(self) -> dict[str, Any]:
        # Tune pickles callbacks with the experiment state; the client holds locks.
        return {**self.__dict__, "_client": None}

    @property
    def served(self) -> bool:
        return self.uri.startswith(("http://", "https://"))

    def check(self) -> None:
        saved = {
            k: os.environ.get(k)
            for k in ("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "MLFLOW_HTTP_REQUEST_TIMEOUT")
        }
        os.environ.update(MLFLOW_HTTP_REQUEST_MAX_RETRIES="0", MLFLOW_HTTP_REQUEST_TIMEOUT="5")
        try:
            MlflowClient(tracking_uri=self.uri).search_experiments(max_results=1)
        except Exception as exc:
            raise ConnectionError(
                f"cannot reach the MLflow tracking store {self.uri!r} ({type(exc).__name__}: "
                f"{str(exc)[:200]}); start the server, fix --tracking-uri / MLFLOW_TRACKING_URI, "
                "or omit it to use results/mlflow.db"
            ) from None
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value

    def experiment(self, name: str, artifact_root: Path) -> str:
        found = self.client.get_experiment_by_name(name)
        if found is not None:
            self._follow_move(found.artifact_location, artifact_root)
            return found.experiment_id
        # A server keeps artifacts in its own store (the UI anywhere shows them).
        location = None if self.served else artifact_root.resolve().as_uri()
        return self.client.create_experiment(name, artifact_location=location)

    def _follow_move(self, recorded: str, artifact_root: Path) -> None:
        """A results folder moved whole (brought back from the host that ran it): MLflow
        keeps each experiment's and run's artifact folder as an absolute path, so new runs
        would write where the folder was and the UI would read there. Where this store's
        SQLite file sits beside `artifact_root` (the results folder's own layout) and the
        experiment's folder is another results folder's, every path under that folder is
        read under this one. MLflow has no call that moves them (mlflow/store/tracking/
        sqlalchemy_store.py: artifact_location is set once, at create_experiment): its own
        tables are updated through its own models."""
        here = artifact_root.resolve()
        database = (
            Path(self.uri.removeprefix("sqlite:///")) if self.uri.startswith("sqlite:///") else None
        )
        if database is None or database.parent != here.parent or not recorded.startswith("file://"):
            return
        was = Path(recorded.removeprefix("file://")).parent  # the results folder it was in
        if was == here.parent:
            return
        from mlflow.exceptions import MlflowException
        from sqlalchemy.exc import SQLAlchemyError

        # A store it may not write (read-only) is read as it is: artifacts where MLflow says.
        with contextlib.suppress(MlflowException, SQLAlchemyError):
            relocate_artifacts(self.uri, was.as_uri(), here.parent.as_uri())

    def log_artifacts(self, run_id: str, local_dir: str, path: str) -> None:
        self.client.log_artifacts(run_id, local_dir, artifact_path=path)

    def set_experiment_tags(self, experiment_id: str, tags: dict[str, str]) -> None:
        for key, value in tags.items():
            self.client.set_experiment_tag(experiment_id, key, value)

    def experiment_tags(self, experiment_id: str) -> dict[str, str]:
        return dict(self.client.get_experiment(experiment_id).tags)

    def create_run(self, experiment_id: str, name: str, tags: dict[str, str]) -> str:
        run_id: str = self.client.create_run(experiment_id, run_name=name, tags=tags).info.run_id
        return run_id

    def log_batch(
        self, run_id: str, metrics: list[MetricRow], params: list[Pair], tags: list[Pair]
    ) -> None:
        self.client.log_batch(
            run_id,
            metrics=[Metric(*m) for m in metrics],
            params=[Param(*p) for p in params],
            tags=[RunTag(*t) for t in tags],
        )

    def log_text(self, run_id: str, text: str, path: str) -> None:
        self.client.log_text(run_id, text, path)

    def set_terminated(self, run_id: str, status: str, end_time: int) -> None:
        self.client.set_terminated(run_id, status, end_time=end_time)

    def search(
        self, experiment_id: str, tags: dict[str, str], status: str | None = None
    ) -> list[str]:
        clauses = [f"tags.`{k}` = '{v}'" for k, v in tags.items()]
        if status:
            clauses.append(f"attributes.status = '{status}'")
        ids, token = [], None
        while True:
            page = self.client.search_runs(
                [experiment_id], " and ".join(clauses), order_by=["attributes.start_time ASC"],
                page_token=token,
            )  # fmt: skip
            ids += [run.info.run_id for run in page]
            token = page.token
            if not token:
                return ids

    def read(self, run_id: str) -> RunRecord:
        run = self.client.get_run(run_id)
        history = {
            name: [(m.step, m.value) for m in self.client.get_metric_history(run_id, name)]
            for name in run.data.metrics
        }
        texts = {}
        with tempfile.TemporaryDirectory() as tmp:
            for item in self.client.list_artifacts(run_id):
                if not item.is_dir:
                    local = self.client.download_artifacts(run_id, item.path, tmp)
                    texts[item.path] = Path(local).read_text()
        return RunRecord(
            run_id=run_id,
            name=run.info.run_name,
            status=run.info.status,
            tags={
                k: v for k, v in run.data.tags.items() if k in PARENT or not k.startswith("mlflow.")
            },
            params=dict(run.data.params),
            metrics=dict(run.data.metrics),
            history=history,
            texts=texts,
            end_time=run.info.end_time,
        )


class MemoryStore:
    """Runs kept in this process, by name: what a pipeline uses when it tracks elsewhere, and
    what tests read back. A sweep's driver (where all tracking happens) holds them; they are
    gone when it exits. `outage()` makes it unreachable for a while, as a server can be."""

    def __init__(self, uri: str):
        self.uri = uri
        self.experiments: dict[str, str] = {}  # name -> id
        self.runs: dict[str, RunRecord] = {}
        self.run_experiment: dict[str, str] = {}
        self.tags: dict[str, dict[str, str]] = {}  # experiment id -> its tags
        self.down = False

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        # Tune pickles the Tracker with its experiment state: in this process a restored
        # sweep finds the same records again.
        return (store_for, (self.uri,))

    @contextlib.contextmanager
    def outage(self) -> Iterator[None]:
        self.down = True
        try:
            yield
        finally:
            self.down = False

    def _reach(self) -> None:
        if self.down:
            raise ConnectionError(f"tracking store {self.uri} is down")

    def check(self) -> None:
        try:
            self._reach()
        except ConnectionError as exc:
            raise ConnectionError(f"{exc}; wait for it, or pass another --tracking-uri") from None

    def experiment(self, name: str, artifact_root: Path) -> str:
        self._reach()
        return self.experiments.setdefault(name, str(len(self.experiments)))

    def set_experiment_tags(self, experiment_id: str, tags: dict[str, str]) -> None:
        self._reach()
        self.tags.setdefault(experiment_id, {}).update(tags)

    def experiment_tags(self, experiment_id: str) -> dict[str, str]:
        self._reach()
        return dict(self.tags.get(experiment_id, {}))

    def create_run(self, experiment_id: str, name: str, tags: dict[str, str]) -> str:
        self._reach()
        run_id = f"mem{len(self.runs):06d}"
        self.runs[run_id] = RunRecord(run_id=run_id, name=name, status="RUNNING", tags=dict(tags))
        self.run_experiment[run_id] = experiment_id
        return run_id

    def _run(self, run_id: str) -> RunRecord:
        self._reach()
        if run_id not in self.runs:
            raise KeyError(f"no run {run_id!r} in {self.uri}")
        return self.runs[run_id]

    def log_batch(
        self, run_id: str, metrics: list[MetricRow], params: list[Pair], tags: list[Pair]
    ) -> None:
        run = self._run(run_id)
        for name, number, _, step in metrics:
            run.history.setdefault(name, []).append((step, number))
            run.metrics[name] = number
        for key, value in params:
            if key in run.params and run.params[key] != value:
                raise ValueError(f"param {key!r} of run {run_id} is already {run.params[key]!r}")
            run.params[key] = value
        run.tags.update(tags)

    def log_text(self, run_id: str, text: str, path: str) -> None:
        self._run(run_id).texts[path] = text

    def log_artifacts(self, run_id: str, local_dir: str, path: str) -> None:
        run = self._run(run_id)
        for file in sorted(Path(local_dir).rglob("*")):
            if file.is_file():
                run.files.append(f"{path}/{file.relative_to(local_dir)}")

    def set_terminated(self, run_id: str, status: str, end_time: int) -> None:
        if status not in TERMINAL:
            raise ValueError(f"{status!r} is not a terminal run status ({', '.join(TERMINAL)})")
        run = self._run(run_id)
        run.status, run.end_time = status, end_time

    def search(
        self, experiment_id: str, tags: dict[str, str], status: str | None = None
    ) -> list[str]:
        self._reach()
        return [
            run_id
            for run_id, run in self.runs.items()
            if self.run_experiment[run_id] == experiment_id
            and all(run.tags.get(k) == v for k, v in tags.items())
            and (status is None or run.status == status)
        ]

    def read(self, run_id: str) -> RunRecord:
        return self._run(run_id)


_MEMORY: dict[str, MemoryStore] = {}  # this process's in-memory stores, by URI


def store_for(uri: str) -> TrackingStore:
    """The store a tracking URI names (one MemoryStore per `memory:` name in a process)."""
    if uri.startswith(MEMORY_SCHEME):
        return _MEMORY.setdefault(uri, MemoryStore(uri))
    return MlflowStore(uri)


# Beside the SQLite files of a results folder: held while a sweep first opens its stores.
SCHEMA_LOCK = ".stores.lock"


@contextlib.contextmanager
def schema_lock(results_dir: Path) -> Iterator[None]:
    """One sweep at a time opens (and so, on first use, creates) the stores of a results
    folder: MLflow and Optuna create their SQLite tables without a lock of their own, and two
    sweeps started together on a new folder raced ("table ... already exists")."""
    import fcntl

    results_dir.mkdir(parents=True, exist_ok=True)
    with open(results_dir / SCHEMA_LOCK, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def open_stores(results_dir: Path, tracking_uri: str, optuna_storage: str) -> None:
    """Reach the tracking store and the Optuna storage, creating their schemas under the
    results folder's lock (raises as check() does when the tracking store cannot be reached)."""
    import optuna

    with schema_lock(results_dir):
        store_for(tracking_uri).check()
        optuna.storages.RDBStorage(optuna_storage)
