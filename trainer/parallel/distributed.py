"""Joining the trainer processes of a multi-host trial (one process per host of a slice)."""

from __future__ import annotations

import itertools

from trainer.trial.config import ConfigError, TrialConfig


def initialize(
    config: TrialConfig, coordinator: str | None, num_processes: int, process_id: int
) -> None:
    """jax.distributed with explicit ids from the engine's reservation, before any backend use."""
    if not coordinator:
        raise ConfigError("coordinator", "--num-processes > 1 needs --coordinator host:port")
    if not 0 <= process_id < num_processes:
        raise ConfigError("process_id", f"{process_id} is not in 0..{num_processes - 1}")
    import jax

    if config.backend == "cpu":
        # XLA:CPU needs a collectives implementation to span processes (simulated hosts).
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=coordinator, num_processes=num_processes, process_id=process_id
    )


# How long the first process at a barrier waits for the others. Hosts of one trial reach the
# first step far apart when one compiles and another hits the persistent cache (seen here:
# 2 s against 51 s); the sweeper's trial timeout, not this, bounds a host that never comes.
BARRIER_TIMEOUT_S = 3600
_BARRIERS = itertools.count()  # every process passes the same barriers in the same order


def barrier(name: str, timeout_s: float = BARRIER_TIMEOUT_S) -> None:
    """Wait until every process of the trial is here, through the coordination service.

    Not a collective: XLA:CPU's gloo context, made at the first collective, gives up on a
    peer after 30 s, and TPU runtimes have their own limits; a service barrier has none but
    its own timeout. Nothing to wait for in a one-process trial.
    """
    import jax

    if jax.process_count() == 1:
        return
    # JAX's own multi-process tests use this client barrier; there is no public one that is
    # not itself a collective (multihost_utils.sync_global_devices all-gathers).
    from jax._src import distributed

    barrier_id = f"sweeper-{name}-{next(_BARRIERS)}"  # an id is used once
    client = distributed.global_state.client
    assert client is not None, "jax.distributed is initialized in a multi-process trial"
    client.wait_at_barrier(barrier_id, int(timeout_s * 1000))


def agree(flag: bool) -> bool:
    """Process 0's value of `flag` on every process, so that all take the same branch."""
    import jax

    if jax.process_count() == 1:
        return flag
    import numpy as np
    from jax.experimental import multihost_utils

    return bool(multihost_utils.broadcast_one_to_all(np.asarray(flag)))
