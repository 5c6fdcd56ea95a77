"""What a sweep produced (`SweepResult`), and the two endings of a sweep that are the user's to
act on: a results folder that took no more writes, and a resume of a sweep that finished."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import optuna
import pandas as pd

from sweeper.answer.recover import sweep_frame
from sweeper.execute.cluster import given_address
from sweeper.record.manifest import (
    JOURNAL,
    SUMMARY,
    Found,
    SweepManifest,
    find_sweep,
    results_dir_of,
    sweeper_command,
)
from sweeper.record.row import TrialRow
from sweeper.record.tracker import Tracker
from sweeper.space.errors import SpaceError
from sweeper.space.schema import Space
from trainer.trial.files import write_text


class ResultsUnwritable(SpaceError):
    """The sweep's end could not be written where its results go: what was not written, why,
    and how to finish it (`sweeper resume`, once there is room)."""

    def __init__(self, sweep_id: str, folder: Path, unwritten: list[str]):
        super().__init__(
            f"sweep {sweep_id}: the results folder {folder} took no more writes "
            f"({'; '.join(unwritten)}). The trials' records are kept where they were written "
            f"(Optuna, MLflow, the trials' folders). Free space (or make it writable), then "
            f"`{sweeper_command('resume', sweep_id, results_dir=results_dir_of(folder), address=given_address())}` "
            "writes the summary, best.yaml and the report",
            file=str(folder),
        )


class SweepFinished(SpaceError):
    """`resume` of a sweep that ended well: nothing to continue (its table rebuilt first, when
    its summary.csv was missing or damaged: `mended` says so)."""

    def __init__(self, path: Path, manifest: SweepManifest, mended: list[str] | None = None):
        ending = manifest.ending
        super().__init__(
            f"sweep {manifest.sweep_id} finished at {ending.ended_at} ({ending.counted()}; best "
            f"trial {ending.best_trial or 'none'}): nothing to resume"
            + "".join(f". {note}" for note in mended or [])
            + f". `{sweeper_command('show', manifest.sweep_id, results_dir=results_dir_of(path))}`"
            " shows it",
            file=str(path),
        )
        self.manifest = manifest


class SweepInterrupted(KeyboardInterrupt):
    """A second Ctrl-C / SIGTERM stopped the sweep at once: its records are closed as killed,
    its manifest says interrupted, and `sweeper resume` continues it."""

    def __init__(self, sweep_id: str, running: list[str]):
        super().__init__(sweep_id)
        self.sweep_id, self.running = sweep_id, running


def unfinished(sweep_id: str, results_dir: Path | None, tracking_uri: str | None) -> Found:
    """The sweep to resume; SweepFinished (after replaying any records an outage kept) when
    it ended well. Needs no Ray: the CLI asks before it starts one."""
    found = find_sweep(sweep_id, results_dir)
    manifest = found.manifest
    assert manifest is not None, "find_sweep reads the manifest"
    if manifest.ending.state == "finished":
        if (found.path / JOURNAL).exists():  # records an outage kept: replay them now
            Tracker(tracking_uri or manifest.tracking_uri, manifest.space, manifest.sweep_id,
                    found.path.parents[1] / "mlartifacts", found.path / JOURNAL,
                    parent_run_id=manifest.parent_run_id).flush()  # fmt: skip
        raise SweepFinished(found.path, manifest, _mend_summary(found))
    return found


def _mend_summary(found: Found) -> list[str]:
    """A finished sweep's summary.csv written again from its runs when it is missing or
    damaged; what was done."""
    frame, said = sweep_frame(found)
    if not said or frame.empty:
        return said
    try:
        write_text(found.path / SUMMARY, frame.to_csv(index=False))
    except OSError as exc:
        return [*said, f"it could not be written back ({exc.strerror or exc})"]
    return [*said, f"written back to {found.path / SUMMARY}"]


@dataclass
class SweepResult:
    """What a sweep produced: every trial (one row each), the best feasible one, and where its
    records are (its manifest: the space as run, the study, the MLflow runs)."""

    manifest: SweepManifest
    sweep_dir: Path
    trials: pd.DataFrame  # the results table (summary.csv): one row per trial
    best: TrialRow | None  # the best trial that ended well, by the space's objective
    counts: dict[str, int] = field(default_factory=dict)
    # Values pinned before sampling, and knobs the trials reported inert/emulated/interpreted.
    notes: list[str] = field(default_factory=list)
    interrupted: bool = False  # Ctrl-C / SIGTERM ended it; its running trials were killed
    journaled: int = 0  # tracking records still waiting in the journal (the store was down)
    # The best trial's configuration as it ran, devices included: `python -m trainer` reruns it.
    best_config: dict[str, Any] | None = None

    @property
    def sweep_id(self) -> str:
        return self.manifest.sweep_id

    @property
    def space(self) -> str:
        """The space's name (its MLflow experiment)."""
        return self.manifest.space.name

    @property
    def space_used(self) -> Space:
        """The space as run: fidelity resolved, inert values pinned, the trial base set."""
        return self.manifest.space

    @property
    def experiment_id(self) -> str:
        return self.manifest.experiment_id

    @property
    def parent_run_id(self) -> str:
        return self.manifest.parent_run_id

    @property
    def tracking_uri(self) -> str:
        return self.manifest.tracking_uri

    @property
    def study_name(self) -> str:
        return self.manifest.study_name

    @property
    def optuna_storage(self) -> str:
        return self.manifest.optuna_storage

    def study(self) -> optuna.Study:
        return optuna.load_study(study_name=self.study_name, storage=self.optuna_storage)
