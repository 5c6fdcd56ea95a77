"""One kernel's program alone: a Splash attention layer (forward, and its backward) at given
per-device shapes, compiled for one device (compile/tiles.py tunes its blocks on it)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import SingleDeviceSharding

from trainer.model.attention import splash_attention
from trainer.trial.config import KernelsConfig


def splash_layer_hlo(
    kernels: KernelsConfig, shapes: dict[str, int], device: Any, backward: bool
) -> str:
    """The optimized HLO of one Splash layer with `kernels`' blocks and layouts: queries
    [batch, seq, heads, head_dim], keys and values over kv_heads, bf16; with `backward`, the
    gradient of all three too. Compiled for `device` (a TPU topology's, ahead of time)."""
    kernels = kernels.model_copy(update={"attention": "splash"})
    b, s, d = shapes["batch"], shapes["seq"], shapes["head_dim"]

    def attend(q, k, v):
        return splash_attention(q, k, v, kernels, False)

    def layer(q, k, v, do):
        if not backward:
            return attend(q, k, v)
        out, vjp = jax.vjp(attend, q, k, v)
        return out, vjp(do)

    sharding = SingleDeviceSharding(device)
    heads = (shapes["heads"], shapes["kv_heads"], shapes["kv_heads"], shapes["heads"])
    args = [jax.ShapeDtypeStruct((b, s, h, d), jnp.bfloat16, sharding=sharding) for h in heads]
    return jax.jit(layer).lower(*args).compile().as_text() or ""
