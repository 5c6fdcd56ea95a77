"""The sweeps a results folder holds: each sweep's manifest (sweep.json: what `sweeper resume`
reattaches, and how the sweep ended), found by id, listed newest first; and the `sweeper`
commands that reach a sweep again, as its messages print them.

Light on purpose: `sweeper list`, `show`, `export` and `ui` read these files and start no Ray.
"""

from __future__ import annotations

import datetime as dt
import secrets
import shlex
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

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
SPACE_AS_RUN = "space.yaml"  # the space as it ran, where a resume must go on as a new sweep
RESULTS = "results"  # the default results folder, in the working directory


def default_results_dir() -> Path:
    """`./results` of the working directory (never the package's own folder)."""
    return Path.cwd() / RESULTS


# The commands a message tells its reader to run next, written to run as copied from where
# the reader stands: the program by a name the shell finds, the sweeps' folder where it is
# not the working directory's `./results`, the options given that the command needs again.
PROGRAM = "sweeper"


def program() -> str:
    """`sweeper` where the shell finds this installation by that name; else its whole path
    (a virtual environment not on PATH), or this Python running the package."""
    script = Path(sys.executable).parent / PROGRAM
    if not script.is_file():
        return f"{shlex.quote(sys.executable)} -m {PROGRAM}"
    on_path = shutil.which(PROGRAM)
    if on_path and Path(on_path).resolve() == script.resolve():
        return PROGRAM
    return shlex.quote(str(script))


def from_here(path: Path | str) -> str:
    """`path` as the working directory reaches it: relative where it lies under it, else
    whole."""
    whole = Path(path).resolve()
    here = Path.cwd().resolve()
    return str(whole.relative_to(here)) if whole.is_relative_to(here) else str(whole)


def sweeper_command(
    *words: str, results_dir: Path | str | None = None, **options: str | None
) -> str:
    """`sweeper WORDS...` for the reader to run from the working directory: `--results-dir`
    when `results_dir` (the sweeps' folder the command reads) is not the default one there,
    then each option given (`tracking_uri="http://..."` as `--tracking-uri http://...`);
    every word quoted for the shell where it needs it."""
    parts = list(words)
    if results_dir is not None and Path(results_dir).resolve() != default_results_dir().resolve():
        parts += ["--results-dir", from_here(results_dir)]
    for name, value in options.items():
        if value:
            parts += [f"--{name.replace('_', '-')}", value]
    return " ".join([program(), *map(shlex.quote, parts)])


def results_dir_of(sweep_dir: Path | str) -> Path:
    """The sweeps' folder a sweep's own folder (`results/<space>/<sweep id>`) lies in."""
    return Path(sweep_dir).parents[1]


State = Literal["running", "finished", "interrupted"]


class Ending(Frozen):
    """How a sweep ended, as its driver recorded it when Tune's experiment ended."""

    state: State = "running"
    ended_at: str = ""  # ISO 8601, local time
    counts: dict[str, int] = Field(default_factory=dict)
    best_trial: str = ""
    best_value: float | None = None
    notes: list[str] = Field(default_factory=list)

    def counted(self) -> str:
        """Its trial counts in words: `5 total, 4 ok, 1 killed`."""
        return ", ".join(f"{n:,} {k}" for k, n in self.counts.items())


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
    # The Ray cluster it ran on by `--address` ("": a private local Ray): resume attaches there.
    ray_address: str = ""
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
        update: dict[str, Any] = {}
        for field in ("tracking_uri", "optuna_storage", "storage"):
            value = getattr(self, field)
            prefix = "sqlite:///" if value.startswith("sqlite:///") else ""
            path = Path(value.removeprefix(prefix))
            if path == written or written in path.parents:
                update[field] = f"{prefix}{results_dir / path.relative_to(written)}"
        # the notes' paths too (the best's profile): said where the folder now is
        notes = [n.replace(f"{written}/", f"{results_dir}/") for n in self.ending.notes]
        update["ending"] = self.ending.model_copy(update={"notes": notes})
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
        f"{what}; `{sweeper_command('list', results_dir=results_dir)}` shows the sweeps there, "
        "--results-dir says where to look",
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
