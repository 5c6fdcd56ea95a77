"""One kernel's program alone, at given per-device shapes (the tile tuner, trainer/compile/
tiles/, compiles or times its candidates this way): a Splash attention layer, or one expert
weight's grouped matmul, each with its backward, or the part of it one kernel runs in."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import SingleDeviceSharding

from trainer.model.grouped_matmul import grouped_matmul, tokamax_tpu_configs
from trainer.model.splash import chunk_splash_attention, splash_attention
from trainer.parallel.context import load_balance_order
from trainer.trial.config import KernelsConfig, PrecisionConfig

Layer = tuple[Callable[..., Any], list[jax.ShapeDtypeStruct]]


def splash_layer(
    kernels: KernelsConfig, shapes: dict[str, int], part: str, interpret: bool = False
) -> Layer:
    """One Splash layer with `kernels`' blocks and layouts: queries [batch, seq, heads,
    head_dim], keys and values over kv_heads, bf16; `part` "forward" its output alone,
    "backward" its output and the gradients of all three (the fused dK/dV kernel's)."""
    kernels = kernels.model_copy(update={"attention": "splash"})
    b, s, d = shapes["batch"], shapes["seq"], shapes["head_dim"]
    context = shapes.get("context", 1)
    c = s // context  # a device's queries (all of them without context parallelism)
    positions = chunk_positions(s, context, bool(shapes.get("load_balanced", False)))

    def attend(q, k, v):
        if context == 1:
            return splash_attention(q, k, v, kernels, interpret)
        return chunk_splash_attention(q, k, v, kernels, interpret, positions)

    def layer(q, k, v, do):
        if part == "forward":
            return attend(q, k, v)
        out, vjp = jax.vjp(attend, q, k, v)
        return out, vjp(do)

    heads = (shapes["heads"], shapes["kv_heads"], shapes["kv_heads"], shapes["heads"])
    lengths = (c, s, s, c)
    return layer, [
        jax.ShapeDtypeStruct((b, n, h, d), jnp.bfloat16)
        for n, h in zip(lengths, heads, strict=True)
    ]


def chunk_positions(seq: int, context: int, load_balanced: bool) -> np.ndarray:
    """The query positions of the device whose Splash kernel a context-parallel trial waits
    on: under load balancing every device's causal work is the same (the first's is taken);
    without, the last device's chunk sees the most keys."""
    c = seq // context
    if load_balanced and context > 1:
        return load_balance_order(seq, context)[:c]
    return np.arange(seq - c, seq)


def gmm_layer(
    kernels: KernelsConfig,
    fp8: PrecisionConfig | None,
    shapes: dict[str, int],
    weight: str,
    part: str,
) -> Layer:
    """One expert weight's grouped matmul as the trial's MoE layer runs it (trainer/model/
    grouped_matmul.py, tokamax on TPU, `weight`'s tiles; `fp8` experts in its kernels):
    routed rows [rows, in] bf16 by [groups, in, out]. `part`: "all" the output and both
    gradients; "fwd" the output alone; "dlhs" with the input's gradient, "drhs" with the
    weight's."""
    kernels = kernels.model_copy(update={"moe_gmm": "tokamax"})
    rows, k, n, g = shapes["rows"], shapes["in"], shapes["out"], shapes["groups"]

    def layer(x, w, sizes, dy):
        def matmul(x, w):
            return grouped_matmul(x, w, sizes, kernels, False, "tpu", fp8, weight)

        if part == "fwd":
            return matmul(x, w)
        if part == "dlhs":
            out, vjp = jax.vjp(lambda x: matmul(x, w), x)
        elif part == "drhs":
            out, vjp = jax.vjp(lambda w: matmul(x, w), w)
        else:
            out, vjp = jax.vjp(matmul, x, w)
        return out, vjp(dy)

    specs = [
        jax.ShapeDtypeStruct((rows, k), jnp.bfloat16),
        jax.ShapeDtypeStruct((g, k, n), jnp.bfloat16),
        jax.ShapeDtypeStruct((g,), jnp.int32),
        jax.ShapeDtypeStruct((rows, n), jnp.bfloat16),
    ]
    return layer, specs


def megablox_layer(kernels: KernelsConfig, shapes: dict[str, int]) -> Layer:
    """An MoE layer's two expert matmuls through Megablox with `kernels`' one tiling
    (gmm_tm/tk/tn, every pass): routed rows [rows, d] bf16 by wi [groups, d, mlp], then by wo
    [groups, mlp, d], and the gradients of all three."""
    kernels = kernels.model_copy(update={"moe_gmm": "megablox"})
    rows, d, mlp, g = shapes["rows"], shapes["in"], shapes["out"], shapes["groups"]

    def layer(x, wi, wo, sizes, dy):
        def experts(x, wi, wo):
            h = grouped_matmul(x, wi, sizes, kernels, False, "tpu")
            return grouped_matmul(h, wo, sizes, kernels, False, "tpu")

        out, vjp = jax.vjp(experts, x, wi, wo)
        return out, vjp(dy)

    specs = [
        jax.ShapeDtypeStruct((rows, d), jnp.bfloat16),
        jax.ShapeDtypeStruct((g, d, mlp), jnp.bfloat16),
        jax.ShapeDtypeStruct((g, mlp, d), jnp.bfloat16),
        jax.ShapeDtypeStruct((g,), jnp.int32),
        jax.ShapeDtypeStruct((rows, d), jnp.bfloat16),
    ]
    return layer, specs


def compiled_hlo(layer: Layer, device: Any, options: dict[str, Any] | None = None) -> str:
    """The optimized HLO of `layer` compiled for `device` (a TPU topology's, ahead of time, or
    this host's) with compiler `options` (a scoped VMEM limit)."""
    fn, specs = layer
    sharding = SingleDeviceSharding(device)
    args = [jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding) for s in specs]
    with jax.default_device(device):  # tokamax picks its kernel by the default device
        lowered = jax.jit(fn).lower(*args)
    return lowered.compile(compiler_options=options).as_text() or ""


def example_args(specs: list[jax.ShapeDtypeStruct], device: Any) -> list[jax.Array]:
    """Arguments of `specs` on `device`: normal floats; an int32 vector is group sizes, the
    rows split evenly over the groups (the first spec's rows)."""
    key = jax.random.key(0)
    out = []
    for i, spec in enumerate(specs):
        if spec.dtype == jnp.int32:
            rows, groups = specs[0].shape[0], spec.shape[0]
            sizes = jnp.full(spec.shape, rows // groups, jnp.int32).at[0].add(rows % groups)
            out.append(jax.device_put(sizes, device))
        else:
            value = jax.random.normal(jax.random.fold_in(key, i), spec.shape, spec.dtype)
            out.append(jax.device_put(value, device))
    return out


def gmm_tiles(
    kernels: KernelsConfig, fp8: bool, shapes: dict[str, int], weight: str
) -> dict[str, tuple[int, int, int] | None]:
    """The (tm, tk, tn) tiles each pass of `weight`'s grouped matmul runs with in the trial's
    program (`tokamax_tpu_configs`); None where tokamax picks its own."""
    rows, k, n, g = shapes["rows"], shapes["in"], shapes["out"], shapes["groups"]
    configs = tokamax_tpu_configs(
        jax.ShapeDtypeStruct((rows, k), jnp.bfloat16),
        jax.ShapeDtypeStruct((g, k, n), jnp.bfloat16),
        weight,
        kernels.tokamax_tiles,
        fp8,
    )
    return {p: (c.tile_m, c.tile_k, c.tile_n) if c else None for p, c in configs.items()}
