"""The MoE grouped matmul: XLA's ragged_dot, tokamax's kernels (Mosaic on TPU, Mosaic GPU
or Triton on NVIDIA GPUs, with their tiles) or Megablox; fp8 experts through
trainer/model/fp8_gmm.py. Off TPU the Pallas kernels run with interpret=True."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu.megablox import ops as megablox
from jax.extend import backend

from trainer.trial import tokamax_tiles
from trainer.trial.config import GMM_PASSES, KernelsConfig, PrecisionConfig, TokamaxTiles
from trainer.trial.hardware import Backend

if TYPE_CHECKING:
    from tokamax._src.ops.ragged_dot import pallas_mosaic_tpu as tokamax_tpu

# tokamax (1.8 s to import) is imported where a trial runs its kernels, not by every trial.

# tokamax's grouped-matmul kernels for NVIDIA GPUs, in tokamax's own order of preference.
# Which of them builds depends on the JAX and tokamax a host carries (seen in deviceless H200
# compiles, benchmarks.gpu_compile): tokamax 0.0.12 builds both under jax 0.10.2 and neither
# under jax 0.11.2 (Mosaic: `Mesh(out_shape=)` rejected; Triton: `pl.dot` removed); tokamax
# 0.0.17 builds Mosaic under jax 0.11.2, and Triton only with jax_triton installed.
TOKAMAX_GPU_GMM = ("mosaic_gpu", "triton")


@functools.cache
def tokamax_gpu_gmm(
    device: jax.Device, candidates: tuple[str, ...] = TOKAMAX_GPU_GMM
) -> tuple[str | None, dict[str, str]]:
    """The first of tokamax's GPU grouped-matmul kernels (`candidates`) that traces for
    `device` (a GPU, or an AOT target's), forward and both gradients on a small problem, or
    None; and why each one before it did not. Tracing is where version skew shows (an API a
    kernel calls is gone); nothing runs."""
    import tokamax
    from tokamax._src import config as tokamax_config

    x = jax.ShapeDtypeStruct((256, 128), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((2, 128, 128), jnp.bfloat16)
    sizes = jax.ShapeDtypeStruct((2,), jnp.int32)
    failures: dict[str, str] = {}
    for name in candidates:

        def loss(x, w, sizes, name=name):
            out = tokamax.ragged_dot(x, w, sizes, implementation=name)
            return jnp.sum(out.astype(jnp.float32))

        try:
            with jax.default_device(device), tokamax_config.cross_compile(True):
                jax.eval_shape(jax.grad(loss, (0, 1)), x, w, sizes)
        except Exception as exc:
            failures[name] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
            continue
        return name, failures
    return None, failures


def experts_run_as(moe_gmm: str, platform: str, device: jax.Device) -> str:
    """What a resolved `moe_gmm` runs as on `device`: for tokamax on a GPU, the kernel that
    builds there, or XLA's ragged_dot with why none did; otherwise the choice itself."""
    if moe_gmm != "tokamax" or platform != "gpu":
        return moe_gmm
    kernel, failures = tokamax_gpu_gmm(device)
    return f"tokamax {kernel}" if kernel else f"ragged_dot ({'; '.join(failures.values())})"


# tokamax's tuned tile tables, read from its source (trainer/trial/tokamax_tiles.py, which
# says when each version has them); the same objects the estimate prices.
_TOKAMAX_TILE_TABLES = tokamax_tiles.TABLES


def tokamax_tpu_configs(
    x_MxK, w_GxKxN, weight: str, tiles: TokamaxTiles, fp8: bool
) -> dict[str, tokamax_tpu.Config | None]:
    """The tile config of tokamax's TPU kernel for each pass (`tokamax_tiles.picks`); None:
    tokamax's own choice."""
    from tokamax._src.ops.ragged_dot import pallas_mosaic_tpu as tokamax_tpu

    (m, k), (groups, _, n) = x_MxK.shape, w_GxKxN.shape
    configs: dict[str, tokamax_tpu.Config | None] = {}
    for name, (picked, buffers) in tokamax_tiles.picks((m, k, n), groups, weight, tiles,
                                                       fp8).items():  # fmt: skip
        if picked:
            tm, tk, tn = picked
            configs[name] = tokamax_tpu.Config(
                tile_m=tm, tile_k=tk, tile_n=tn, input_buffer_count=buffers
            )
        else:
            configs[name] = None
    return configs


def _tokamax_tpu(config: tokamax_tpu.Config | None, **fields):
    """tokamax's TPU kernel with `config` (None: its choice), then its XLA path where the
    kernel declines a shape (any dim under 128), as tokamax's default order does."""
    from tokamax._src.ops.ragged_dot import pallas_mosaic_tpu as tokamax_tpu

    return (tokamax_tpu.PallasMosaicTpuRaggedDot(config=config, **fields), "xla")


def tokamax_tpu_gmm(x_MxK, w_GxKxN, group_sizes_G, weight: str, tiles: TokamaxTiles):
    """tokamax.ragged_dot on TPU with the knob's tiles for each pass (tokamax's own VJP, its
    gradient kernels given their tiles); without any, tokamax's default (its table's tiles,
    tokamax 0.0.12) or MaxText's (tokamax 0.0.17)."""
    import tokamax
    from tokamax._src.ops.ragged_dot import base as ragged_dot_base
    from tokamax._src.ops.ragged_dot import pallas_mosaic_tpu as tokamax_tpu

    if tiles.is_default and tokamax_tiles.UNSET is None:
        return tokamax.ragged_dot(x_MxK, w_GxKxN, group_sizes_G)
    configs = tokamax_tpu_configs(x_MxK, w_GxKxN, weight, tiles, fp8=False)
    dlhs, drhs = (tokamax_tpu.PallasMosaicTpuRaggedDot(config=configs[p]) for p in ("dlhs", "drhs"))
    vjp = functools.partial(ragged_dot_base.vjp, dlhs_ragged_dot=dlhs, drhs_ragged_dot=drhs)
    implementation = _tokamax_tpu(configs["fwd"], vjp=vjp)
    return tokamax.ragged_dot(x_MxK, w_GxKxN, group_sizes_G, implementation=implementation)


def default_device() -> jax.Device:
    """The device programs are being built for (set by `jax.default_device`, as an AOT
    lowering does), else this host's first."""
    return backend.get_default_device()


def grouped_matmul(
    x_MxK,
    w_GxKxN,
    group_sizes_G,
    kernels: KernelsConfig,
    interpret: bool,
    platform: str = "cpu",
    fp8: PrecisionConfig | None = None,
    weight: str = "wi",
):
    """Dropless grouped matmul: lax.ragged_dot (XLA), tokamax.ragged_dot (its kernel for the
    backend: Mosaic on TPU, the first of `TOKAMAX_GPU_GMM` that builds on GPU; XLA's
    ragged_dot where it has none) or Megablox GMM (Pallas). `fp8`: the experts are fp8 in
    tokamax's kernels (trainer/model/fp8_gmm.py; on TPU, and on CPU through tokamax's XLA path,
    which multiplies the dequantized operands: the same quantization, emulated). `weight`
    (wi, wo) picks tokamax's TPU tiles (`kernels.tokamax_tiles`)."""
    if fp8 is not None:  # moe_gmm tokamax, not on GPU (config.check_fp8_experts)
        from trainer.model.fp8_gmm import Fp8Gmm, fp8_grouped_matmul

        passes: tuple = ("xla",) * 3
        if platform == "tpu":
            configs = tokamax_tpu_configs(x_MxK, w_GxKxN, weight, kernels.tokamax_tiles, True)
            passes = tuple(_tokamax_tpu(configs[p]) for p in GMM_PASSES)
        how = Fp8Gmm.of(fp8, passes)
        return fp8_grouped_matmul(x_MxK, w_GxKxN, group_sizes_G, how)
    moe_gmm = kernels.resolved_moe_gmm(Backend(platform))
    if moe_gmm == "tokamax" and platform != "tpu":
        # Its GPU kernel where one builds; else XLA's ragged_dot itself (the program of
        # moe_gmm ragged_dot, as the knob's effect then says), not tokamax's own XLA path.
        kernel = tokamax_gpu_gmm(default_device())[0] if platform == "gpu" else None
        if kernel:
            import tokamax

            return tokamax.ragged_dot(x_MxK, w_GxKxN, group_sizes_G, implementation=kernel)
        moe_gmm = "ragged_dot"
    if moe_gmm == "ragged_dot":
        return jax.lax.ragged_dot(x_MxK, w_GxKxN, group_sizes_G)
    if moe_gmm == "tokamax":  # on TPU, tokamax's own order: its Mosaic TPU kernel first
        return tokamax_tpu_gmm(x_MxK, w_GxKxN, group_sizes_G, weight, kernels.tokamax_tiles)
    tiling = (kernels.gmm_tm, kernels.gmm_tk, kernels.gmm_tn)
    # ops.gmm is the differentiable (custom_vjp) entry; its static arguments are positional.
    return megablox.gmm(
        x_MxK, w_GxKxN, group_sizes_G, x_MxK.dtype, tiling, None, None, False, interpret
    )
