"""Remat policies of KNOBS.md mapped to jax.checkpoint policies."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

from trainer.config import RematConfig

_QKV = ("query_proj", "key_proj", "value_proj", "qkv_proj")
_MINIMAL = (*_QKV, "out_proj", "mlpwi_0", "mlpwi_1", "mlpwi", "mlpwo")
_SAVED: dict[str, tuple[str, ...]] = {
    "minimal": _MINIMAL,
    "minimal_with_context": (*_MINIMAL, "context"),
    "save_dot_with_context_except_mlp": (*_QKV, "context", "out_proj"),
    "save_dot_except_mlpwi": (*_QKV, "out_proj", "mlpwo"),
    "save_dot_except_mlp": (*_QKV, "out_proj"),
    "save_qkv_proj": _QKV,
    "save_out_proj": ("out_proj",),
}
_OFFLOADED: dict[str, tuple[str, ...]] = {
    "qkv_proj_offloaded": _QKV,
    "minimal_offloaded": _MINIMAL,
}


def _offload(saved: tuple[str, ...], offloaded: tuple[str, ...]) -> Callable[..., Any]:
    return jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=list(saved),
        names_which_can_be_offloaded=list(offloaded),
        offload_src="device",
        offload_dst="pinned_host",
    )


def placements(remat: RematConfig) -> dict[str, tuple[str, ...]]:
    """Tensor names kept on device and offloaded to host; everything else is recomputed."""
    if remat.policy == "custom":
        device = tuple(n for n, p in remat.custom.items() if p == "device")
        offload = tuple(n for n, p in remat.custom.items() if p == "offload")
        # decoder_layer_input is the checkpoint boundary and saved unless placed otherwise.
        if "decoder_layer_input" not in remat.custom:
            device = ("decoder_layer_input", *device)
        return {"device": device, "offload": offload}
    return {"device": _SAVED.get(remat.policy, ()), "offload": _OFFLOADED.get(remat.policy, ())}


def checkpoint_policy(remat: RematConfig) -> Callable[..., Any] | None:
    """The policy for jax.checkpoint; None saves nothing but the layer input (`full`)."""
    if remat.policy == "full":
        return None
    placed = placements(remat)
    if placed["offload"]:
        return _offload(placed["device"], placed["offload"])
    return jax.checkpoint_policies.save_only_these_names(*placed["device"])


def uses_offload(remat: RematConfig) -> bool:
    return bool(placements(remat)["offload"])
