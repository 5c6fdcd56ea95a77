"""The Ray cluster a sweep runs on: started privately (or attached to), quiet unless asked,
read once for where the space's trials run, and shut down when this process started it."""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import ray

from sweeper.execute import tune_state
from sweeper.execute.host import tcp_refused
from sweeper.execute.placement import (
    Host,
    Placement,
    alive_hosts,
    compile_placement,
    driver_host,
    find_slices,
    resolve,
)
from sweeper.execute.processes import lease_folder
from sweeper.space.errors import SpaceError
from sweeper.space.fidelity import with_fidelity
from sweeper.space.schema import Space
from trainer.trial.events import Fidelity


def place(space: Space, hosts: list[Host] | None = None) -> tuple[Space, Placement]:
    """Read the Ray cluster (or `hosts`, the first the driver's: a sweep without Ray gives
    this host alone): resolve `auto` fidelity and where each trial runs.

    Raises SpaceError, before any trial, when the cluster cannot hold the space's trials.
    """
    if hosts is None:
        hosts = alive_hosts()
        driver = driver_host(hosts)
    else:
        driver = hosts[0]
    if space.fidelity == "auto" and space.target.is_tpu and not space.target.is_multi_slice:
        slices, _ = find_slices(hosts, space.target.tpu)
        space = with_fidelity(space, "run" if slices else "compile")
    if space.effective_fidelity == Fidelity.RUN:
        return space, resolve(space, hosts, driver)
    return space, compile_placement(space, hosts)


TOKEN_NOTICE = "ray._private.authentication.authentication_token_setup"
# Whether this process started the Ray it uses (a Ray it found is the caller's to stop).
_RAY_STARTED_HERE = False
# The Ray cluster `--address` named, once attached: `sweeper resume` must attach to it again.
_RAY_ADDRESS: str | None = None


def given_address() -> str | None:
    """The Ray cluster this process attached to by `--address` (None: a private local Ray, or
    a caller's Ray it found running): a printed `sweeper resume` names it again."""
    return _RAY_ADDRESS


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


# Ray's switch for clusters of several hosts (ray/_private/ray_constants.py, read when Ray is
# imported): off, a node's address resolves to loopback (services.get_node_ip_address) and
# every server Ray starts for it (GCS, raylet, workers, the monitor, the agents) listens there.
LOOPBACK_ONLY = ("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
# The niceness Ray adds to its workers' (RayConfig's worker_niceness, an increment over the
# raylet's, read by the raylet from its environment; Ray's default 15). A trial's trainer is
# a child of its worker and inherits it: on a host with other work it then waits behind all
# of it. Measured (2026-12-07, 2 cores): a 3-trial CPU sweep beside two busy loops started its
# first trial after 95 s and its second 63 s after the first ended, where 4 s each on the
# quiet host; the trials' own steps barely slowed. A private Ray's workers add none: they run
# at the driver's own niceness.
WORKER_NICENESS = "RAY_worker_niceness"


def start_ray(address: str | None = None) -> None:
    """Attach to `address`, or start a private local Ray (never a stray cluster in /tmp/ray)
    that listens on loopback only: nothing of it is reachable from another host."""
    global _RAY_STARTED_HERE, _RAY_ADDRESS
    if ray.is_initialized():
        return
    _RAY_STARTED_HERE, _RAY_ADDRESS = True, address
    if address is None:
        _loopback_only()
        os.environ.setdefault(WORKER_NICENESS, "0")
    try:
        ray.init(
            address=address or "local",
            include_dashboard=False,
            log_to_driver=False,
            logging_level=logging.WARNING,
            # Remote nodes import the engine and trainer from the driver's copy of the code.
            runtime_env=shipped_code() if address else None,
        )
    except Exception as exc:  # Ray raises bare Exception when its node does not come up
        _RAY_STARTED_HERE, _RAY_ADDRESS = False, None
        refused = tcp_refused()
        why = f" ({refused})" if refused else ""
        raise SpaceError(
            f"Ray could not {'reach ' + address if address else 'start here'}{why}: "
            f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[-1][:300].rstrip('.')}. "
            "Without Ray, `--executor host` runs the trials one at a time on this host",
            field="--executor" if address is None else "--address",
        ) from None


def _loopback_only() -> None:
    """Ray's nodes started from here resolve their address to loopback: set for this process
    (Ray read the switch when it was imported) and its children (Ray's servers and workers)."""
    from ray._private import ray_constants

    name, value = LOOPBACK_ONLY
    os.environ[name] = value
    ray_constants.ENABLE_RAY_CLUSTER = False


def stop_ray() -> None:
    """Shut down the Ray this process started, and remove what it left in the host's
    temporary folder unless a resume needs it (Tune's staging copies of a sweep that did not
    end well); leave a Ray it found running."""
    global _RAY_STARTED_HERE
    if _RAY_STARTED_HERE and ray.is_initialized():
        context = ray.get_runtime_context()
        session = Path(context.get_temp_dir()) / context.get_session_name()
        node_id = context.get_node_id()
        with _ctrl_c_held():
            ray.shutdown()
        shutil.rmtree(lease_folder(node_id), ignore_errors=True)
        _remove_session(session)
    _RAY_STARTED_HERE = False


@contextlib.contextmanager
def _ctrl_c_held() -> Iterator[None]:
    """Ray's shutdown is not cut by a Ctrl-C (a cut one leaves its servers running, and the
    KeyboardInterrupt would replace the sweep's own ending): one that arrives meanwhile is
    dropped, the sweep being over by then. Only the main thread can hold it."""
    try:
        before = signal.signal(signal.SIGINT, lambda *_: None)
    except ValueError:
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, before)


def _remove_session(session: Path) -> None:
    """A Ray session folder this process made (logs, sockets, runtime resources), once no
    sweep's staging copy of Tune's state is left in it."""
    if not session.name.startswith("session_") or any(
        session.glob(f"artifacts/*/*/{tune_state.STAGING}")
    ):
        return
    shutil.rmtree(session, ignore_errors=True)
    latest = session.parent / "session_latest"
    with contextlib.suppress(OSError):
        if latest.is_symlink() and not latest.exists():
            latest.unlink()


def shipped_code() -> dict[str, Any]:
    import sweeper
    import trainer

    return {"py_modules": [str(Path(m.__path__[0])) for m in (sweeper, trainer)]}
