"""Tune's experiment state as `sweeper resume` needs it: whole, or mended from the copy Tune
wrote first, or said to be lost.

Tune writes its state (experiment_state-*.json, the searcher's state) to a staging folder in
Ray's session folder, then copies it to the sweep's storage. A results folder that fills
mid-sweep cuts that copy short; given a cut copy, `Tuner.restore` logs "Failed to restore the
run state" and starts the experiment afresh, which would run the sweep's trials again and
call it complete with a fraction of them. Before restoring, the storage copy is read; a cut
one is replaced by the staging copy where that is whole (Ray's temporary folder is rarely on
the results folder's disk), else `sweeper resume` refuses the sweep by name.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickletools
import shutil
import tempfile
from pathlib import Path

from trainer.trial.files import write_bytes

STATE = "experiment_state-*.json"  # Tune's CKPT_FILE_TMPL; the newest name is the live one
PICKLE = b"\x80"  # the PROTO opcode every pickle since protocol 2 starts with
STAGING = "driver_artifacts"  # <ray tmp>/session_*/artifacts/<time>/<experiment>/driver_artifacts


def damaged(path: Path) -> str | None:
    """Why Tune could not read this state file, or None: JSON must parse, a pickle must run to
    its STOP opcode (walked, never loaded: nothing in it is executed). Told apart by content:
    Tune's search_gen_state-*.json is a pickle."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        return f"{path.name}: {exc.strerror or exc}"
    try:
        if data[:1] == PICKLE:
            for _ in pickletools.genops(data):
                pass
        else:
            json.loads(data)
    except (ValueError, UnicodeDecodeError) as exc:  # JSONDecodeError is a ValueError
        return f"{path.name} is cut short or damaged ({len(data):,} bytes: {exc})"
    return None


def _session_files(folder: Path) -> list[Path]:
    """The newest session's state files in an experiment folder: experiment state, searcher."""
    states = sorted(folder.glob(STATE))
    if not states:
        return []
    session = states[-1].name.removeprefix("experiment_state-").removesuffix(".json")
    files = folder.glob(f"*-{session}.*")  # not a searcher's `.<uuid>-tmp-...` cut mid-save:
    return sorted(  # Tune renames it to its name once whole and never reads it (searcher.py)
        p for p in files if p.suffix in (".json", ".pkl") and not p.name.startswith(".")
    )


def problems(experiment: Path) -> list[str]:
    """What in the storage copy of Tune's state Tune could not read (nothing: restore it)."""
    files = _session_files(experiment)
    if not files:
        return [f"no {STATE} in {experiment}"]
    return [why for p in files if (why := damaged(p))]


def staging_copies(experiment: str) -> list[Path]:
    """Ray's staging folders of this experiment, newest first (one per driver that ran it)."""
    base = Path(os.environ.get("RAY_TMPDIR") or tempfile.gettempdir()) / "ray"
    found = {p.resolve() for p in base.glob(f"session_*/artifacts/*/{experiment}/{STAGING}")}
    return sorted(found, key=lambda p: p.stat().st_mtime, reverse=True)  # session_latest: once


def mend(experiment: Path) -> str | None:
    """Replace a damaged storage copy of Tune's state with a whole staging copy of the same
    session (the same file names, so Tune picks it as the newest). What was done, or None when
    the storage copy is whole or no staging copy can mend it."""
    if not problems(experiment):
        return None
    names = {p.name for p in _session_files(experiment)}
    for staging in staging_copies(experiment.name):
        files = _session_files(staging)
        whole = files and not any(damaged(p) for p in files)
        if not whole or (names and not names <= {p.name for p in files}):
            continue
        for source in files:  # each file whole or as it was, even on a disk still full
            write_bytes(experiment / source.name, source.read_bytes(), durable=True)
        return f"Tune's state in {experiment} was cut short; mended from Ray's copy in {staging}"
    return None


def in_storage(path: str, experiment: Path) -> str:
    """A trial output's path in Ray's staging folder as its copy in the sweep's storage (Tune
    copies the staging folder there, the last time before the experiment ends), where that
    copy exists; any other path as it is."""
    marker = f"/{experiment.name}/{STAGING}/"
    if marker not in path:
        return path
    copy = experiment / path.split(marker, 1)[1]
    return str(copy) if copy.exists() else path


def clean_staging(experiment: str) -> list[Path]:
    """Remove Ray's staging folders of a finished experiment (its trials' configs, logs and
    traces, copied to the sweep's storage): what was removed. Only this machine's: a remote
    node's staging folder is that node's."""
    removed = []
    for staging in staging_copies(experiment):
        folder = staging.parent  # <ray tmp>/session_*/artifacts/<time>/<experiment>
        shutil.rmtree(folder, ignore_errors=True)
        with contextlib.suppress(OSError):
            folder.parent.rmdir()  # the time folder, once empty
        removed.append(folder)
    return removed
