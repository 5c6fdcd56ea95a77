"""MLflow writes that could not reach the tracking store, kept on disk in order and replayed.

While the store is down every write goes to the journal, runs created meanwhile get a
local id, and the sweep keeps running. When the store answers again (or at `sweeper
resume`) the journal is replayed in order, local ids become real run ids, and the file
is emptied. The file is rewritten atomically after every change, so a killed driver
loses nothing it had accepted.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import requests
from mlflow.exceptions import MlflowException

from trainer.trial.files import UNWRITABLE, write_json

LOCAL_PREFIX = "journal-"
# MLflow error codes of a store that is down or overloaded, not of a bad request.
OUTAGE_CODES = frozenset({"INTERNAL_ERROR", "TEMPORARILY_UNAVAILABLE", "REQUEST_LIMIT_EXCEEDED"})


def is_outage(exc: BaseException) -> bool:
    """True when `exc` says the tracking store could not be reached, not that the call was wrong."""
    if isinstance(exc, MlflowException):
        return exc.error_code in OUTAGE_CODES
    return isinstance(exc, requests.RequestException | ConnectionError | TimeoutError)


def read_state(path: Path, keys: tuple[str, ...], fix: str) -> dict[str, Any]:
    """A sweep's JSON state file (empty when absent); SpaceError naming it, what is wrong and
    `fix` when it is damaged (not JSON, not a mapping, or without `keys`)."""
    from sweeper.space.errors import SpaceError

    if not path.exists():
        return {}
    try:
        state = json.loads(path.read_text())
        if not isinstance(state, dict) or any(k not in state for k in keys):
            raise ValueError(f"not a mapping with {', '.join(keys)}")
    except (OSError, ValueError) as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise SpaceError(
            f"damaged ({str(exc).splitlines()[0][:200]}); {fix}", file=str(path)
        ) from None
    return state


class TrackingJournal:
    """Pending MLflow operations (JSON) and the local -> real run ids resolved so far."""

    def __init__(self, path: Path):
        self.path = path
        state = read_state(
            path,
            ("pending", "resolved", "count"),
            "its tracking writes not yet made cannot be replayed: move it aside to go on "
            "without them (MLflow then lacks them; summary.csv, Optuna and Tune keep every result)",
        )
        self.pending: list[dict[str, Any]] = state.get("pending", [])
        self.resolved: dict[str, str] = state.get("resolved", {})
        self.count = state.get("count", 0)
        # Why the file could not be written (a folder full or read-only): the records are
        # then in this driver's memory only, and every message says so.
        self.unwritable: str | None = None

    @property
    def where(self) -> str:
        """Where the waiting records are, as a message says it."""
        if self.unwritable is None:
            return str(self.path)
        return (f"this driver's memory only ({self.path} could not be written: "
                f"{self.unwritable}; they are lost if the driver dies)")  # fmt: skip

    def __len__(self) -> int:
        return len(self.pending)

    def resolve(self, run_id: str) -> str:
        return self.resolved.get(run_id, run_id)

    def append(self, op: str, **args: Any) -> str | None:
        """Keep one operation; a create_run gets (and returns) a local run id."""
        local = None
        if op == "create_run":
            self.count += 1
            local = args["local_id"] = f"{LOCAL_PREFIX}{self.count}"
        self.pending.append({"op": op, **args})
        self._save()
        return local

    def replay(self, apply: Callable[[dict[str, Any]], str | None]) -> None:
        """Apply pending operations in order; stop at the first failure (it raises)."""
        while self.pending:
            entry = dict(self.pending[0])
            if "run_id" in entry:
                entry["run_id"] = self.resolve(entry["run_id"])
            real = apply(entry)
            if entry["op"] == "create_run":
                assert real is not None, "a created run has an id"
                self.resolved[entry["local_id"]] = real
            self.pending.pop(0)
            self._save()

    def _save(self) -> None:
        state = {"pending": self.pending, "resolved": self.resolved, "count": self.count,
                 "saved_at": time.time()}  # fmt: skip
        try:
            write_json(self.path, state, durable=True)
        except OSError as exc:
            if exc.errno not in UNWRITABLE:
                raise
            self.unwritable = exc.strerror or str(exc)
        else:
            self.unwritable = None
