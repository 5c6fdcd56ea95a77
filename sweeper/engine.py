"""What a sweep is before it runs: its space checked (one validation path, for `sweeper
validate` and every sweep), the Ray cluster read, and where each trial will run.

The lifecycle that uses these (prepare -> tuner -> finish) is `sweeper.sweep.Sweep`.
"""

from __future__ import annotations

import datetime as dt
import logging
import os
import secrets
from pathlib import Path
from typing import Any

import ray

from sweeper.inert import pin_inert
from sweeper.placement import (
    Placement,
    alive_hosts,
    compile_placement,
    driver_host,
    find_slices,
    resolve,
)
from sweeper.search import check_sampler
from sweeper.space import (
    Space,
    SpaceError,
    check_feasible,
    check_warm_start,
    count_points,
)

# A run-fidelity trial measures what an estimate only predicts: the measured twin of each.
MEASURED_TWIN = {
    "est_tokens_per_sec_per_chip": "tokens_per_sec_per_chip",
    "est_mfu": "mfu",
    "est_step_time_s": "step_time_median_s",
}


def with_fidelity(space: Space, fidelity: str) -> Space:
    """`auto` made concrete; a run keeps the objective but optimises its measured twin."""
    data = space.model_dump(mode="json")
    data["fidelity"] = fidelity
    if fidelity == "run":
        for objective in filter(None, data["objective"].values()):
            metric = objective["metric"]
            if metric.startswith("est_"):
                if metric not in MEASURED_TWIN:
                    raise SpaceError(
                        f"{metric} is an estimate and the trials will run on the cluster's hardware; "
                        f"use one of {sorted(MEASURED_TWIN.values())} or fidelity compile",
                        field="objective",
                    )
                objective["metric"] = MEASURED_TWIN[metric]
    return Space.model_validate(data)


def place(space: Space) -> tuple[Space, Placement]:
    """Read the Ray cluster: resolve `auto` fidelity and where each trial runs.

    Raises SpaceError, before any trial, when the cluster cannot hold the space's trials.
    """
    hosts = alive_hosts()
    driver = driver_host(hosts)
    if space.fidelity == "auto" and space.is_tpu_target and not space.is_multi_slice:
        slices, _ = find_slices(hosts, space.target)
        space = with_fidelity(space, "run" if slices else "compile")
    if space.effective_fidelity == "run":
        return space, resolve(space, hosts, driver)
    return space, compile_placement(space, hosts)


def cap_grid(space: Space) -> tuple[Space, list[str]]:
    """A grid sweep runs each point once: more trials than points would repeat them."""
    points = count_points(space)
    if space.search.sampler != "grid" or points is None or space.search.trials <= points:
        return space, []
    search = space.search.model_copy(update={"trials": points})
    note = f"search.trials {space.search.trials} capped at {points}: the grid has {points} points"
    return space.model_copy(update={"search": search}), [note]


TOKEN_NOTICE = "ray._private.authentication.authentication_token_setup"
# Whether this process started the Ray it uses (a Ray it found is the caller's to stop).
_RAY_STARTED_HERE = False


def quiet(verbose: bool = False) -> None:
    """No library banners unless `verbose`: Tune's experiment box and TensorBoard hint (its
    legacy reporter at verbosity 0 prints nothing), Optuna's study notices, MLflow's schema
    creation; warnings still show. Set before Ray and Tune start (they read the environment)."""
    if verbose:
        return
    os.environ.setdefault("RAY_AIR_NEW_OUTPUT", "0")
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    for name in ("mlflow", "alembic"):
        logging.getLogger(name).setLevel(logging.WARNING)
    # Ray says a local cluster has token authentication (its default): it keeps it, quietly.
    logging.getLogger(TOKEN_NOTICE).setLevel(logging.ERROR)


def start_ray(address: str | None = None) -> None:
    """Attach to `address`, or start a private local Ray (never a stray cluster in /tmp/ray)."""
    global _RAY_STARTED_HERE
    if ray.is_initialized():
        return
    _RAY_STARTED_HERE = True
    ray.init(
        address=address or "local",
        include_dashboard=False,
        log_to_driver=False,
        logging_level=logging.WARNING,
        # Remote nodes import the engine and trainer from the driver's copy of the code.
        runtime_env=shipped_code() if address else None,
    )


def stop_ray() -> None:
    """Shut down the Ray this process started; leave one it found running."""
    global _RAY_STARTED_HERE
    if _RAY_STARTED_HERE and ray.is_initialized():
        ray.shutdown()
    _RAY_STARTED_HERE = False


def shipped_code() -> dict[str, Any]:
    import sweeper
    import trainer

    return {"py_modules": [str(Path(m.__path__[0])) for m in (sweeper, trainer)]}


def check_flags(space: Space) -> None:
    """An unknown LIBTPU flag would abort every trial that carries it: refuse it before the
    sweep. The flags are the base trial's and each value of an `xla.` knob (load_space has
    checked that each makes a valid trial)."""
    if space.target == "local":
        return
    from trainer.spec.config import XlaFlagsConfig
    from trainer.spec.flags import unknown_flag

    base = space.base_trial().get("xla", {})
    candidates = [("trial.xla", base)] + [
        (f"knobs.{key}", {**base, key.removeprefix("xla."): value})
        for key, knob in space.knobs.items()
        if key.startswith("xla.")
        for value in knob.extremes()
    ]
    for field, xla in candidates:
        flags = XlaFlagsConfig.model_validate(xla).libtpu_init_args()
        rejected = unknown_flag(tuple(flags))
        if rejected:
            raise SpaceError(f"{rejected}; libtpu would abort every trial with it", field=field)


def check_space(
    space: Space, backend: str | None = None, num_devices: int | None = None
) -> tuple[Space, list[str]]:
    """The one validation path of a space, for `sweeper validate` and for every sweep: LIBTPU
    flags, values inert on `backend` pinned away (with a note each), then warm-start points,
    feasibility on `num_devices` and the sampler, on the space as it will be sampled.
    Raises SpaceError naming the field."""
    check_flags(space)
    pinned, notes = pin_inert(space, backend)
    if notes:  # load_space checked the warm start against the space as written
        on = f" on {backend}" if backend else ""
        check_warm_start(pinned, why=f" once values inert{on} are pinned away")
    check_feasible(pinned, num_devices)
    try:
        check_sampler(pinned)
    except ValueError as exc:
        message = str(exc).removeprefix("search.sampler: ")
        raise SpaceError(message, field="search.sampler") from None
    return pinned, notes


def new_sweep_id() -> str:
    return dt.datetime.now().strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(2)
