"""`run_sweep`: a whole sweep, or a resume, in one call (what the CLI drives)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ray import tune

from sweeper.execute.cluster import quiet, stop_ray
from sweeper.space.schema import Space
from sweeper.sweep.lifecycle import Sweep
from sweeper.sweep.result import SweepResult


def run_sweep(
    space: Space | str | Path | None = None,
    *,
    results_dir: Path | None = None,
    tracking_uri: str | None = None,
    progress: bool = False,
    callbacks: list[tune.Callback] | None = None,
    storage: str | None = None,
    study: str | None = None,
    resume: str | None = None,
    verbose: bool = False,
    executor: str = "auto",
    **overrides: Any,
) -> SweepResult:
    """Run a whole sweep and return its result; overrides are dotted space keys (`search.trials=4`).

    `resume=SWEEP_ID` continues a sweep whose driver died or was stopped instead. Prints
    nothing unless `progress` (the sweep's own lines) or `verbose` (the libraries' too). A
    Ray this call started is shut down when it returns; one the caller started is not.
    `executor`: ray, host (no Ray: one trial at a time on this host) or auto (Sweep.prepare).
    """
    quiet(verbose)
    try:
        return _run_sweep(space, results_dir, tracking_uri, progress, callbacks, storage, study,
                          resume, overrides, executor)  # fmt: skip
    finally:
        stop_ray()


def _run_sweep(
    space: Space | str | Path | None,
    results_dir: Path | None,
    tracking_uri: str | None,
    progress: bool,
    callbacks: list[tune.Callback] | None,
    storage: str | None,
    study: str | None,
    resume: str | None,
    overrides: dict[str, Any],
    executor: str,
) -> SweepResult:
    if resume is not None:
        if space is not None or overrides:
            raise TypeError("resume continues a sweep as it was: pass no space or overrides")
        sweep = Sweep.resume(resume, results_dir=results_dir, tracking_uri=tracking_uri)
    elif space is None:
        raise TypeError("give a space (a path, a built-in name or a Space) or resume=SWEEP_ID")
    else:
        sweep = Sweep.prepare(space, results_dir=results_dir, tracking_uri=tracking_uri,
                              storage=storage, study=study, executor=executor,
                              **overrides)  # fmt: skip
    return sweep.run(callbacks, progress)
