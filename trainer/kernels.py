"""Attention and MoE grouped-matmul implementations: XLA references and Pallas TPU kernels.

On TPU the Pallas kernels run compiled; elsewhere they run with interpret=True, which
proves wiring, tile validation and numerics, and says nothing about speed.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu.megablox import ops as megablox
from tokamax._src.ops.experimental.tpu.splash_attention import splash_attention_kernel as splash
from tokamax._src.ops.experimental.tpu.splash_attention import splash_attention_mask as splash_mask

from trainer.config import KernelsConfig


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


def _splash_kernel(
    seq_len: int, blocks: tuple[tuple[str, int], ...], max_logit_const, interpret: bool
):
    config = splash.SplashConfig(
        **dict(blocks), max_logit_const=max_logit_const, interpret=interpret
    )
    return splash.make_splash_mqa_single_device(
        mask=splash_mask.CausalMask((seq_len, seq_len)), config=config
    )


def splash_attention(q_BxSxHxD, k_BxSxKxD, v_BxSxKxD, kernels: KernelsConfig, interpret: bool):
    """Splash attention (tokamax's Pallas TPU kernel), one MQA kernel per kv head: exact GQA."""
    b, s, h, d = q_BxSxHxD.shape
    kv = k_BxSxKxD.shape[2]
    kernel = _splash_kernel(s, tuple(kernels.blocks().items()), kernels.max_logit_const, interpret)
    # The kernel does not scale q.
    q_BxKxGxSxD = (q_BxSxHxD * (d**-0.5)).reshape(b, s, kv, h // kv, d).transpose(0, 2, 3, 1, 4)
    k_BxKxSxD = k_BxSxKxD.transpose(0, 2, 1, 3)
    v_BxKxSxD = v_BxSxKxD.transpose(0, 2, 1, 3)
    per_head = jax.vmap(jax.vmap(kernel))  # over batch, then kv heads
    out_BxKxGxSxD = per_head(q_BxKxGxSxD, k_BxKxSxD, v_BxKxSxD)
    return out_BxKxGxSxD.transpose(0, 3, 1, 2, 4).reshape(b, s, h, d)


def sharded_splash_attention(
    q_BxSxHxD, k_BxSxKxD, v_BxSxKxD, kernels: KernelsConfig, interpret: bool
):
    """Splash under shard_map: a Pallas kernel is a custom call the SPMD partitioner cannot split.

    Batch is split over (data, fsdp, expert) and heads over tensor; each device runs the
    kernel on its whole sequence (context parallelism is refused before this point).
    """
    from jax.sharding import PartitionSpec as P

    from trainer.config import BATCH_AXES

    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return splash_attention(q_BxSxHxD, k_BxSxKxD, v_BxSxKxD, kernels, interpret)
    spec = P(BATCH_AXES, None, "tensor", None)
    body = functools.partial(splash_attention, kernels=kernels, interpret=interpret)
    return jax.shard_map(
        body, mesh=mesh, in_specs=(spec, spec, spec), out_specs=spec, check_vma=False
    )(q_BxSxHxD, k_BxSxKxD, v_BxSxKxD)


def grouped_matmul(x_MxK, w_GxKxN, group_sizes_G, kernels: KernelsConfig, interpret: bool):
    """Dropless grouped matmul: lax.ragged_dot (XLA) or Megablox GMM (Pallas)."""
    if kernels.moe_gmm == "ragged_dot":
        return jax.lax.ragged_dot(x_MxK, w_GxKxN, group_sizes_G)
    tiling = (kernels.gmm_tm, kernels.gmm_tk, kernels.gmm_tn)
    # ops.gmm is the differentiable (custom_vjp) entry; its static arguments are positional.
    return megablox.gmm(
        x_MxK, w_GxKxN, group_sizes_G, x_MxK.dtype, tiling, None, None, False, interpret
    )
