"""Attention through XLA: the reference (any mask from positions) and jax.nn's fused
attention (cuDNN's on NVIDIA GPUs). Splash, tokamax's Pallas TPU kernel, is in
trainer/model/splash.py."""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp


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


def fused_attention(
    q_BxSxHxD, k_BxSxKxD, v_BxSxKxD, implementation: Literal["xla", "cudnn"] | None = "cudnn"
):
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
