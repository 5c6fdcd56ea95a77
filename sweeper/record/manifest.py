"""The sweeps a results folder holds: each sweep's manifest (sweep.json: what `sweeper resume`
reattaches, and how the sweep ended), found by id, listed newest first.

Light on purpose: `sweeper list`, `show`, `export` and `ui` read these files and start no Ray.
"""

from __future__ import annotations

import datetime as dt
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import Field

from sweeper.space.errors import SpaceError
from sweeper.space.schema import Space
from trainer.trial.files import write_json
from trainer.trial.schema import Frozen

# A sweep's files, in its folder (results/<space>/<sweep id>/).
MANIFEST = "sweep.json"  # this manifest
SUMMARY = "summary.csv"  # the results table
BEST = "best.yaml"  # the best trial, its knobs and configuration
JOURNAL = "tracking_journal.json"  # tracking writes waiting for the store to come back
ID_MAP = "mlflow_runs.json"  # trial -> tracking run, and each trial's attempts
RESULTS = "results"  # the default results folder, in the working directory


def default_results_dir() -> Path:
    """`./results` of the working directory (never the package's own folder)."""
    return Path.cwd() / RESULTS


State = Literal["running", "finished", "interrupted"]


class Ending(Frozen):
    """How a sweep ended, as its driver recorded it when Tune's experiment ended."""

    state: State = "running"
    ended_at: str = ""  # ISO 8601, local time
    counts: dict[str, int] = Field(default_factory=dict)
    best_trial: str = ""
    best_value: float | None = None
    notes: list[str] = Field(default_factory=list)


class SweepManifest(Frozen):
    """A sweep's durable identity: the space as run, the study, the tracking records, Tune's
    storage, and how it ended."""

    sweep_id: str
    space: Space
    study_name: str
    own_study: bool
    optuna_storage: str
    tracking_uri: str
    experiment_id: str
    parent_run_id: str
    storage: str
    # What schedules its trials: Ray Tune, or this host alone without Ray (sweeper/sweep/host.py).
    executor: Literal["ray", "host"] = "ray"
    inert_notes: list[str] = Field(default_factory=list)
    started_at: str = ""
    ending: Ending = Ending()

    def write(self, path: Path) -> None:
        write_json(path, self.model_dump(mode="json"), indent=1, durable=True)

    def moved_to(self, results_dir: Path) -> SweepManifest:
        """This sweep read from `results_dir` after its results folder was moved (brought back
        from the host that ran it): the paths it recorded under the folder it was written in
        (its Optuna study is always there) are read under `results_dir`; a store elsewhere (a
        tracking server, a file the user named) is kept."""
        written = Path(self.optuna_storage.removeprefix("sqlite:///")).parent
        if written == results_dir:
            return self
        update = {}
        for field in ("tracking_uri", "optuna_storage", "storage"):
            value = getattr(self, field)
            prefix = "sqlite:///" if value.startswith("sqlite:///") else ""
            path = Path(value.removeprefix(prefix))
            if path == written or written in path.parents:
                update[field] = f"{prefix}{results_dir / path.relative_to(written)}"
        return self.model_copy(update=update)

    @classmethod
    def read(cls, path: Path) -> SweepManifest:
        try:
            return cls.model_validate_json(path.read_text())
        except (OSError, ValueError) as exc:  # ValidationError is a ValueError
            raise SpaceError(
                f"cannot read the sweep's manifest ({str(exc).splitlines()[0][:200]}); it is "
                "damaged or from another version: start a new sweep",
                file=str(path),
            ) from None


def now() -> str:
    return dt.datetime.now().isoformat(timespec="seconds")


def new_sweep_id() -> str:
    """A sweep's id: when it started, and 4 hex digits that tell apart sweeps of one second."""
    return dt.datetime.now().strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(2)


@dataclass(frozen=True)
class Found:
    """A sweep in a results folder (`problem` says why its manifest cannot be read)."""

    path: Path
    manifest: SweepManifest | None
    problem: str = ""

    @property
    def sweep_id(self) -> str:
        return self.path.name


def find_sweep(sweep_id: str, results_dir: Path | None = None) -> Found:
    """The sweep `sweep_id` (or a unique prefix of it) under `results_dir`; SpaceError
    naming the latest ones when there is none."""
    results_dir = results_dir or default_results_dir()
    found = sorted(results_dir.glob(f"*/{sweep_id}*/{MANIFEST}"))
    exact = [p for p in found if p.parent.name == sweep_id]
    if len(exact) == 1 or len(found) == 1:
        path = (exact or found)[0]
        return Found(path.parent, SweepManifest.read(path).moved_to(results_dir.resolve()))
    latest = [s.sweep_id for s in list_sweeps(results_dir)[:5]]
    if found:
        what = f"several sweeps start with {sweep_id!r}: {', '.join(p.parent.name for p in found)}"
    else:
        what = f"no sweep {sweep_id!r} (latest: {', '.join(latest) or 'none'})"
    raise SpaceError(
        f"{what}; `sweeper list` shows the sweeps, --results-dir says where to look",
        file=str(results_dir),
        field="SWEEP_ID",
    )


def list_sweeps(results_dir: Path | None = None) -> list[Found]:
    """Every sweep under `results_dir`, newest first; one whose manifest cannot be read is
    listed with why."""
    results_dir = results_dir or default_results_dir()
    sweeps = []
    for path in results_dir.glob(f"*/*/{MANIFEST}"):
        try:
            sweeps.append(Found(path.parent, SweepManifest.read(path)))
        except SpaceError as exc:
            sweeps.append(Found(path.parent, None, exc.message))
    return sorted(sweeps, key=lambda s: s.sweep_id, reverse=True)
