"""Remat policies (trainer.trial.remat) as jax.checkpoint policies."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

from trainer.trial.remat import RematConfig, placements


def _offload(saved: tuple[str, ...], offloaded: tuple[str, ...]) -> Callable[..., Any]:
    return jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=list(saved),
        names_which_can_be_offloaded=list(offloaded),
        offload_src="device",
        offload_dst="pinned_host",
    )


def checkpoint_policy(remat: RematConfig) -> Callable[..., Any] | None:
    """The policy for jax.checkpoint; None saves nothing but the layer input (`full`)."""
    if remat.policy == "full":
        return None
    placed = placements(remat)
    if placed["offload"]:
        return _offload(placed["device"], placed["offload"])
    return jax.checkpoint_policies.save_only_these_names(*placed["device"])
