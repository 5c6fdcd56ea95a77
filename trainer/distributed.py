"""Joining the trainer processes of a multi-host trial (one process per host of a slice)."""

from __future__ import annotations

from trainer.config import ConfigError, TrialConfig


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


def agree(flag: bool) -> bool:
    """Process 0's value of `flag` on every process, so that all take the same branch."""
    import jax

    if jax.process_count() == 1:
        return flag
    import numpy as np
    from jax.experimental import multihost_utils

    return bool(multihost_utils.broadcast_one_to_all(np.asarray(flag)))
