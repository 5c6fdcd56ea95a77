"""Splash attention, tokamax's Pallas TPU kernel: over a whole causal sequence, one device's
query chunk under context parallelism, and under shard_map on a mesh.

On TPU it runs compiled; elsewhere with interpret=True, which proves wiring, tile validation
and numerics, and says nothing about speed. Imported only by a trial that runs it: tokamax
takes 1.8 s to import.
"""

from __future__ import annotations

import functools

import jax
import numpy as np
from tokamax._src.ops.experimental.tpu.splash_attention import splash_attention_kernel as splash
from tokamax._src.ops.experimental.tpu.splash_attention import splash_attention_mask as splash_mask

from trainer.parallel.context import load_balance_order, natural_chunk_order
from trainer.trial.config import KernelsConfig
from trainer.trial.remat import Tensor


def splash_config(
    kernels: KernelsConfig, interpret: bool, q_len: int, kv_len: int
) -> splash.SplashConfig:
    return splash.SplashConfig(
        **kernels.blocks(q_len, kv_len),
        **{f"{x}_layout": splash.QKVLayout[getattr(kernels, f"{x}_layout").upper()] for x in "qkv"},
        max_logit_const=kernels.max_logit_const,
        dq_reduction_steps=kernels.dq_reduction_steps or None,
        interpret=interpret,
        # The kernel names its output and logsumexp "context" (as MaxText's does): a remat
        # policy that saves the context saves what the fused backward reads, and the backward
        # does not run the forward kernel again.
        residual_checkpoint_name=Tensor.CONTEXT,
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


def chunk_splash_attention(
    q_BxCxHxD, k_BxSxKxD, v_BxSxKxD, kernels: KernelsConfig, interpret: bool, positions
):
    """One device's Splash kernel under context parallelism, alone: its query chunk (the
    sequence positions `positions`, in the order it holds them) against every key, causal by
    position. The kernel `sharded_splash_attention` runs on that device, without the mesh (the
    tile tuner compiles it so)."""
    c, s = q_BxCxHxD.shape[1], k_BxSxKxD.shape[1]
    mask = ChunkCausalMask(np.asarray(positions), s)
    kernel = splash.make_splash_mqa_single_device(
        mask=mask, config=splash_config(kernels, interpret, c, s)
    )
    return _run_kernel(kernel, q_BxCxHxD, k_BxSxKxD, v_BxSxKxD)


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

    from trainer.trial.config import BATCH_AXES

    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return splash_attention(q_BxSxHxD, k_BxSxKxD, v_BxSxKxD, kernels, interpret)
    context = mesh.shape["context"]
    if context == 1:
        spec = P(BATCH_AXES, None, "tensor", None)
        whole = functools.partial(splash_attention, kernels=kernels, interpret=interpret)
        return jax.shard_map(
            whole, mesh=mesh, in_specs=(spec, spec, spec), out_specs=spec, check_vma=False
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


class ChunkCausalMask(splash_mask._ComputableMask):
    """Causal attention for queries at sequence positions `positions`, computed inside the
    kernel: row r is the query at position positions[r], columns are key positions. One
    device's query chunk under context parallelism (the tile tuner's), or every row
    (LoadBalancedCausalMask)."""

    def __init__(self, positions: np.ndarray, kv_len: int):
        super().__init__(shape=(len(positions), kv_len), mask_function=lambda q, kv: q >= kv)
        self.q_sequence = positions.astype(np.int32)

    def __eq__(self, other: object):
        if not isinstance(other, ChunkCausalMask):
            return NotImplemented
        return self.shape == other.shape and np.array_equal(self.q_sequence, other.q_sequence)

    def __hash__(self):
        return hash((type(self), self.shape, self.q_sequence.tobytes()))


class LoadBalancedCausalMask(ChunkCausalMask):
    """Causal attention for every query in load-balanced order (as MaxText's mask of the same
    name): row r is the query at position load_balance_order[r]. `context` 1 is the plain
    causal mask. Equal by shape and context (its order follows from them)."""

    def __init__(self, shape: tuple[int, int], context: int):
        order = load_balance_order(shape[0], context) if context > 1 else np.arange(shape[0])
        super().__init__(order, shape[1])
        self.context = context

    def __eq__(self, other: object):
        if not isinstance(other, LoadBalancedCausalMask):
            return NotImplemented
        return self.shape == other.shape and self.context == other.context

    def __hash__(self):
        return hash((type(self), self.shape, self.context))
