"""Attention and MoE grouped-matmul implementations: XLA references, Pallas TPU kernels,
and the GPU's fused kernels (cuDNN attention, tokamax's grouped matmul).

On TPU the Pallas kernels run compiled; elsewhere they run with interpret=True, which
proves wiring, tile validation and numerics, and says nothing about speed.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import tokamax
from absl import flags
from jax.experimental.pallas.ops.tpu.megablox import ops as megablox
from jax.extend import backend
from tokamax._src.ops.experimental.tpu.splash_attention import splash_attention_kernel as splash
from tokamax._src.ops.experimental.tpu.splash_attention import splash_attention_mask as splash_mask
from tokamax._src.ops.ragged_dot import base as ragged_dot_base
from tokamax._src.ops.ragged_dot import pallas_mosaic_tpu as tokamax_tpu

from trainer.config import GMM_PASSES, KernelsConfig, PrecisionConfig, TokamaxTiles
from trainer.data import load_balance_order
from trainer.fp8_gmm import Fp8Gmm, fp8_grouped_matmul

# tokamax reads its absl flags on first use, parsing sys.argv if nobody has: our own command
# lines (the trainer's, a benchmark's) are not absl's, so its defaults are taken as parsed.
if not flags.FLAGS.is_parsed():
    flags.FLAGS.mark_as_parsed()


def reference_attention(
    q_BxSxHxD, k_BxTxKxD, v_BxTxKxD, q_pos_BxS, k_pos_BxT, max_logit_const=None
):
    """Grouped-query causal attention; the mask comes from positions, so a permuted sequence works.

    With `max_logit_const` the softmax subtracts that constant instead of the running max
    (exp(s - c)); a constant too small for the logits overflows to inf/NaN, by design
    detectable.
    """
    b, s, h, d = q_BxSxHxD.shape
    kv = k_BxTxKxD.shape[2]
    q_BxSxKxGxD = q_BxSxHxD.reshape(b, s, kv, h // kv, d) * (d**-0.5)
    scores = jnp.einsum("bskgd,btkd->bkgst", q_BxSxKxGxD, k_BxTxKxD).astype(jnp.float32)
    mask = q_pos_BxS[:, None, None, :, None] >= k_pos_BxT[:, None, None, None, :]
    if max_logit_const is None:
        scores = jnp.where(mask, scores, jnp.finfo(jnp.float32).min)
        probs = jax.nn.softmax(scores, axis=-1)
    else:
        unnormalized = jnp.where(mask, jnp.exp(scores - max_logit_const), 0.0)
        probs = unnormalized / jnp.sum(unnormalized, axis=-1, keepdims=True)
    out = jnp.einsum("bkgst,btkd->bskgd", probs.astype(v_BxTxKxD.dtype), v_BxTxKxD)
    return out.reshape(b, s, h, d)


def fused_attention(q_BxSxHxD, k_BxSxKxD, v_BxSxKxD, implementation: str | None = "cudnn"):
    """Causal grouped-query attention through jax.nn.dot_product_attention: cuDNN's flash
    attention on NVIDIA GPUs (no S x S scores in memory). Positions are the natural order
    (no context sharding, no load-balanced permutation); `implementation="xla"` is the same
    call through XLA, which lets a CPU test check everything around the cuDNN kernel."""
    d = q_BxSxHxD.shape[-1]
    return jax.nn.dot_product_attention(
        q_BxSxHxD,
        k_BxSxKxD,
        v_BxSxKxD,
        scale=d**-0.5,
        is_causal=True,
        implementation=implementation,
    )


def splash_config(
    kernels: KernelsConfig, interpret: bool, q_len: int, kv_len: int
) -> splash.SplashConfig:
    return splash.SplashConfig(
        **kernels.blocks(q_len, kv_len),
        **{f"{x}_layout": splash.QKVLayout[getattr(kernels, f"{x}_layout").upper()] for x in "qkv"},
        max_logit_const=kernels.max_logit_const,
        interpret=interpret,
        # The kernel names its output and logsumexp "context" (as MaxText's does): a remat
        # policy that saves the context saves what the fused backward reads, and the backward
        # does not run the forward kernel again.
        residual_checkpoint_name="context",
    )


def _run_kernel(kernel, q_BxSxHxD, k_BxTxKxD, v_BxTxKxD):
    """One MQA kernel per kv head (exact GQA), vmapped over batch and kv heads."""
    b, s, h, d = q_BxSxHxD.shape
    kv = k_BxTxKxD.shape[2]
    # The kernel does not scale q.
    q_BxKxGxSxD = (q_BxSxHxD * (d**-0.5)).reshape(b, s, kv, h // kv, d).transpose(0, 2, 3, 1, 4)
    k_BxKxTxD = k_BxTxKxD.transpose(0, 2, 1, 3)
    v_BxKxTxD = v_BxTxKxD.transpose(0, 2, 1, 3)
    out_BxKxGxSxD = jax.vmap(jax.vmap(kernel))(q_BxKxGxSxD, k_BxKxTxD, v_BxKxTxD)
    return out_BxKxGxSxD.transpose(0, 3, 1, 2, 4).reshape(b, s, h, d)


def splash_attention(q_BxSxHxD, k_BxSxKxD, v_BxSxKxD, kernels: KernelsConfig, interpret: bool):
    """Splash attention (tokamax's Pallas TPU kernel) over a whole causal sequence."""
    s = q_BxSxHxD.shape[1]
    # Built per trace, not cached: the kernel holds arrays made inside the current trace.
    kernel = splash.make_splash_mqa_single_device(
        mask=splash_mask.CausalMask((s, s)), config=splash_config(kernels, interpret, s, s)
    )
    return _run_kernel(kernel, q_BxSxHxD, k_BxSxKxD, v_BxSxKxD)


def sharded_splash_attention(
    q_BxSxHxD,
    k_BxSxKxD,
    v_BxSxKxD,
    kernels: KernelsConfig,
    interpret: bool,
    load_balanced: bool = False,
):
    """Splash under shard_map: a Pallas kernel is a custom call the SPMD partitioner cannot split.

    Batch is split over (data, fsdp, expert), heads over tensor and, with context
    parallelism, the query sequence over context: each device keeps its query chunk,
    all-gathers keys and values, and reads its rows of the (load-balanced) causal mask,
    which the kernel holds sharded by query (q_seq_shards).
    """
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from trainer.config import BATCH_AXES

    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return splash_attention(q_BxSxHxD, k_BxSxKxD, v_BxSxKxD, kernels, interpret)
    context = mesh.shape["context"]
    if context == 1:
        spec = P(BATCH_AXES, None, "tensor", None)
        body = functools.partial(splash_attention, kernels=kernels, interpret=interpret)
        return jax.shard_map(
            body, mesh=mesh, in_specs=(spec, spec, spec), out_specs=spec, check_vma=False
        )(q_BxSxHxD, k_BxSxKxD, v_BxSxKxD)
    s = q_BxSxHxD.shape[1]
    # Lazy: the kernel computes causality from each row's position; no S x S array exists.
    mask = LoadBalancedCausalMask((s, s), context if load_balanced else 1)
    kernel = splash.make_splash_mqa(
        mask=mask, config=splash_config(kernels, interpret, s // context, s), q_seq_shards=context
    )
    kernel_spec = kernel.manual_sharding_spec(NamedSharding(mesh, P("context")))
    spec = P(BATCH_AXES, "context", "tensor", None)

    def body(kernel, q, k, v):
        k = jax.lax.all_gather(k, "context", axis=1, tiled=True)
        v = jax.lax.all_gather(v, "context", axis=1, tiled=True)
        if load_balanced:  # gathered in the pipeline's order; the mask's columns are positions
            k, v = (natural_chunk_order(x, context) for x in (k, v))
        return _run_kernel(kernel, q, k, v)

    return jax.shard_map(
        body, mesh=mesh, in_specs=(kernel_spec, spec, spec, spec), out_specs=spec, check_vma=False
    )(kernel, q_BxSxHxD, k_BxSxKxD, v_BxSxKxD)


def natural_chunk_order(x_BxSx___, context: int):
    """Undo the load-balancing permutation along axis 1 (trainer.data.load_balance_order):
    chunk pairs (i, 2c-1-i) back to chunks 0..2c-1, by static slices."""
    chunks = jnp.split(x_BxSx___, 2 * context, axis=1)  # [0, 2c-1, 1, 2c-2, ...]
    first, second = chunks[0::2], chunks[1::2]
    return jnp.concatenate(first + second[::-1], axis=1)


class LoadBalancedCausalMask(splash_mask._ComputableMask):
    """Causal attention for queries in load-balanced order, computed inside the kernel (as
    MaxText's mask of the same name): row r is the query at position order[r], columns are
    key positions. `context` 1 is the plain causal mask."""

    def __init__(self, shape: tuple[int, int], context: int):
        super().__init__(shape=shape, mask_function=lambda q, kv: q >= kv)
        self.context = context
        self.order = load_balance_order(shape[0], context) if context > 1 else np.arange(shape[0])
        self.q_sequence = self.order.astype(np.int32)

    def __eq__(self, other: object):
        if not isinstance(other, LoadBalancedCausalMask):
            return NotImplemented
        return self.shape == other.shape and self.context == other.context

    def __hash__(self):
        return hash((type(self), self.shape, self.context))


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


# tokamax's tuned tiles for its TPU kernels, by (m, k, n, groups, quantized): m routed rows,
# k the input's features, n the output's; one table per pass (see TokamaxTiles).
_TOKAMAX_TILE_TABLES = {
    "fwd": tokamax_tpu.GMM_TILING_TUNED_LUT,
    "dlhs": tokamax_tpu.GMM_RHS_TRANSPOSE_TILING_TUNED_LUT,
    "drhs": tokamax_tpu.TGMM_TILING_TUNED_LUT,
}


def tokamax_tpu_configs(
    x_MxK, w_GxKxN, weight: str, tiles: TokamaxTiles, fp8: bool
) -> dict[str, tokamax_tpu.Config | None]:
    """The tile config of tokamax's TPU kernel for each pass: the knob's (clamped to the
    pass's dims); else, for fp8 operands where tokamax's table has no fp8 entry, its bf16 one
    for the shape (tokamax would take 128 x 128 x 128, a quarter of TPU7x's MXU; fp8 tiles
    take half the VMEM of bf16 ones); else None, tokamax's own choice."""
    (m, k), (groups, _, n) = x_MxK.shape, w_GxKxN.shape
    chosen = tiles.of(weight, {"fwd": (m, k, n), "dlhs": (m, n, k), "drhs": (m, k, n)})
    configs: dict[str, tokamax_tpu.Config | None] = {}
    for name in GMM_PASSES:
        table, buffers = _TOKAMAX_TILE_TABLES[name], 2
        tuned = table.get((m, k, n, groups, False))
        if not chosen[name] and fp8 and (m, k, n, groups, True) not in table and tuned:
            chosen[name], buffers = tuned
        if chosen[name]:
            tm, tk, tn = chosen[name]
            configs[name] = tokamax_tpu.Config(
                tile_m=tm, tile_k=tk, tile_n=tn, input_buffer_count=buffers
            )
        else:
            configs[name] = None
    return configs


def _tokamax_tpu(config: tokamax_tpu.Config | None, **fields):
    """tokamax's TPU kernel with `config` (None: its choice), then its XLA path where the
    kernel declines a shape (any dim under 128), as tokamax's default order does."""
    return (tokamax_tpu.PallasMosaicTpuRaggedDot(config=config, **fields), "xla")


def tokamax_tpu_gmm(x_MxK, w_GxKxN, group_sizes_G, weight: str, tiles: TokamaxTiles):
    """tokamax.ragged_dot on TPU with the knob's tiles for each pass (tokamax's own VJP, its
    gradient kernels given their tiles); without any, tokamax's default."""
    if tiles.is_default:
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
    tokamax's kernels (trainer/fp8_gmm.py; on TPU, and on CPU through tokamax's XLA path,
    which multiplies the dequantized operands: the same quantization, emulated). `weight`
    (wi, wo) picks tokamax's TPU tiles (`kernels.tokamax_tiles`)."""
    if fp8 is not None:  # moe_gmm tokamax, not on GPU (config.check_fp8_experts)
        passes: tuple = ("xla",) * 3
        if platform == "tpu":
            configs = tokamax_tpu_configs(x_MxK, w_GxKxN, weight, kernels.tokamax_tiles, True)
            passes = tuple(_tokamax_tpu(configs[p]) for p in GMM_PASSES)
        how = Fp8Gmm.of(fp8, passes)
        return fp8_grouped_matmul(x_MxK, w_GxKxN, group_sizes_G, how)
    moe_gmm = kernels.resolved_moe_gmm(platform)
    if moe_gmm == "tokamax" and platform != "tpu":
        # Its GPU kernel where one builds; else XLA's ragged_dot itself (the program of
        # moe_gmm ragged_dot, as the knob's effect then says), not tokamax's own XLA path.
        kernel = tokamax_gpu_gmm(default_device())[0] if platform == "gpu" else None
        if kernel:
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
