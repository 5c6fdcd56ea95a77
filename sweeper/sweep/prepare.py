"""What a sweep's lifecycle needs before Tune runs: the space as its sweep runs it (checked,
placed, inert values pinned), how many trials at once, the trial base every trial shares,
and the records a resume must find."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import optuna

from sweeper.execute.cluster import place
from sweeper.execute.host import tcp_refused
from sweeper.execute.placement import Host, Placement
from sweeper.execute.programs import program_of
from sweeper.record.manifest import sweeper_command
from sweeper.space.checks import cap_grid, check_space
from sweeper.space.errors import SpaceError
from sweeper.space.schema import Space


def check_study_exists(name: str, storage: str, sweep_id: str, results_dir: Path) -> None:
    """The sweep's Optuna study must still be where it began: the search's memory (and each
    trial's result) is there; without it a resume cannot tell what ran."""
    try:
        optuna.load_study(study_name=name, storage=storage)
    except KeyError:
        show = sweeper_command("show", sweep_id, results_dir=results_dir)
        raise SpaceError(
            f"sweep {sweep_id}: its Optuna study '{name}' is not in {storage} (the file was "
            "deleted or replaced), so the sweep cannot be resumed. Its trials' records are in "
            f"MLflow and summary.csv if it was written (`{show}`); put the "
            "study's file back to resume, or start a new sweep",
            file=storage.removeprefix("sqlite:///"),
            field="sweeper resume",
        ) from None


def local_path(path: str) -> Path | None:
    """A storage path on this machine's filesystem, or None for remote storage (s3://, ...)."""
    if path.startswith("file://"):
        return Path(path.removeprefix("file://"))
    return None if "://" in path else Path(path)


def checked(
    space: Space, hosts: list[Host] | None = None
) -> tuple[Space, Placement, list[str], list[str]]:
    """The space as its sweep runs it, where its trials run (on Ray's cluster, or on `hosts`),
    the values pinned as inert (a note each), and notes on the placement."""
    program_of(space).check(space)
    space, placement = place(space, hosts)
    backend = placement.backend if space.effective_fidelity == "run" else None
    space, inert_notes = check_space(space, backend, placement.num_devices)
    space, grid_note = cap_grid(space)
    notes = [f"placement: {placement.description}", *grid_note, *concurrency(space, placement)[1]]
    return space, placement, inert_notes, notes


def concurrency(space: Space, placement: Placement) -> tuple[int, list[str]]:
    """Trials at once: the space's, capped at what the cluster holds (with a note then)."""
    allowed = min(space.search.concurrency, placement.capacity)
    if allowed == space.search.concurrency:
        return allowed, []
    many = "s" if placement.capacity > 1 else ""
    return allowed, [
        f"search.concurrency {space.search.concurrency} capped at {allowed}: "
        f"the cluster holds {placement.capacity} such trial{many} at once"
    ]


def with_trial_base(space: Space, placement: Placement, storage: str) -> Space:
    """The trial base every trial of the sweep shares: where the trainers run, the cache."""
    base = space.base_trial()
    if space.effective_fidelity == "run":
        base["backend"] = placement.backend  # the trainers run where the sweep reserved
    # The convergence reference cache lives in the sweep's storage, which every node reads.
    base.setdefault("convergence", {}).setdefault("cache_dir", f"{storage}/cache")
    return space.model_copy(update={"trial": {k: v for k, v in base.items() if k != "model"}})


Executor = Literal["ray", "host"]
EXECUTORS = ("auto", "ray", "host")


def choose_executor(requested: str, space: Space) -> tuple[Executor, list[str]]:
    """What schedules a sweep's trials, and a note when it is not what a user would expect:
    `ray` and `host` as asked; `auto` is Ray (the caller's, or a private local one) unless
    this host cannot start Ray and the caller has none. SpaceError for a space whose trials
    need a Ray cluster (a TPU slice at run fidelity) without one."""
    import ray

    if requested not in EXECUTORS:
        raise SpaceError(
            f"executor {requested!r}: one of {', '.join(EXECUTORS)}", field="--executor"
        )
    if requested == "ray" or (requested == "auto" and ray.is_initialized()):
        return "ray", []
    refused = tcp_refused()
    if requested == "auto" and refused is None:
        return "ray", []
    needs_cluster = space.target.is_tpu and space.fidelity == "run"
    if needs_cluster:
        why = f"Ray cannot start here: {refused}" if refused else "executor host was asked for"
        raise SpaceError(
            f"{space.target} at fidelity run trains on whole slices of a Ray cluster; {why}. "
            "Run it where Ray can reach the slices (--address), or use fidelity compile",
            field="target",
        )
    if requested == "host":
        return "host", ["executor host: trials run one at a time on this host, without Ray"]
    return "host", [
        f"executor host: Ray cannot start here ({refused}), so the trials run one at a time "
        "on this host, without Ray (--executor ray asks for Ray)"
    ]
