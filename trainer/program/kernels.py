"""One kernel's program alone, at given per-device shapes, compiled for one device (the tile
tuner, trainer/compile/tiles/, compiles its candidates this way): a Splash attention layer,
or one expert weight's grouped matmul, each with its backward."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import SingleDeviceSharding

from trainer.model.attention import splash_attention
from trainer.model.grouped_matmul import grouped_matmul
from trainer.trial.config import KernelsConfig, PrecisionConfig


def splash_layer_hlo(
    kernels: KernelsConfig,
    shapes: dict[str, int],
    device: Any,
    backward: bool,
    options: dict[str, Any] | None = None,
) -> str:
    """The optimized HLO of one Splash layer with `kernels`' blocks and layouts: queries
    [batch, seq, heads, head_dim], keys and values over kv_heads, bf16; with `backward`, the
    gradient of all three too. Compiled for `device` (a TPU topology's, ahead of time) with
    compiler `options` (a scoped VMEM limit)."""
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
    return jax.jit(layer).lower(*args).compile(compiler_options=options).as_text() or ""


def gmm_layer_hlo(
    kernels: KernelsConfig,
    fp8: PrecisionConfig | None,
    shapes: dict[str, int],
    device: Any,
    weight: str,
    options: dict[str, Any] | None = None,
) -> str:
    """The optimized HLO of one expert weight's grouped matmul as the trial's MoE layer runs
    it (trainer/model/grouped_matmul.py, tokamax on TPU, `weight`'s tiles; `fp8` experts in
    its kernels): routed rows [rows, in] bf16 by [groups, in, out], and the gradients of
    both. Compiled for `device` with compiler `options`."""
    kernels = kernels.model_copy(update={"moe_gmm": "tokamax"})
    rows, k, n, g = shapes["rows"], shapes["in"], shapes["out"], shapes["groups"]

    def layer(x, w, sizes, dy):
        def matmul(x, w):
            return grouped_matmul(x, w, sizes, kernels, False, "tpu", fp8, weight)

        out, vjp = jax.vjp(matmul, x, w)
        return out, vjp(dy)

    sharding = SingleDeviceSharding(device)
    args = [
        jax.ShapeDtypeStruct((rows, k), jnp.bfloat16, sharding=sharding),
        jax.ShapeDtypeStruct((g, k, n), jnp.bfloat16, sharding=sharding),
        jax.ShapeDtypeStruct((g,), jnp.int32, sharding=sharding),
        jax.ShapeDtypeStruct((rows, n), jnp.bfloat16, sharding=sharding),
    ]
    with jax.default_device(device):  # tokamax picks its kernel by the default device
        lowered = jax.jit(layer).lower(*args)
    return lowered.compile(compiler_options=options).as_text() or ""
