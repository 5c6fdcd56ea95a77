"""The language-model loss over the vocabulary, whole or in tiles.

The logits stay in the unembedding's dtype (bf16 on TPU: the matmul's output, as MaxText's
before its `cast_logits_to_fp32`); the loss and its gradient are computed from them in
float32 inside fused reductions (a custom VJP over the unembedding and the loss that saves
the logits and each token's log-sum-exp, and runs the two gradient matmuls one after the
other), so no float32 [batch, seq, vocab] array is made and at most one bf16 gradient of
the logits is: the values are MaxText's, float32 logits of bf16 numbers. With
`vocab_tiling` 1 the logits exist in full. With N > 1 (MaxText's `num_vocab_tiling`) the
tokens are split into N tiles along the sequence; each tile's logits are made, reduced to
its loss and dropped, and made again in the backward pass (jax.checkpoint), so only one
tile's logits is ever live. The cost is one more unembedding matmul per step.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

LOGITS_AXES = ("activation_batch", "activation_length", "activation_vocab")


def unembed(x_BxSxE: jax.Array, w_ExV: jax.Array) -> jax.Array:
    """Logits in the matmul's output dtype, sharded like MaxText's (batch, length, vocab)."""
    logits = jax.lax.dot_general(x_BxSxE, w_ExV, (((2,), (0,)), ((), ())))
    return nn.with_logical_constraint(logits, LOGITS_AXES)


@jax.custom_vjp
def token_losses(x_BxSxE: jax.Array, w_ExV: jax.Array, targets_BxS: jax.Array) -> jax.Array:
    """Cross entropy of each token under the unembedding `w`, in float32: log-sum-exp of its
    logits minus its target's logit."""
    return _token_losses(x_BxSxE, w_ExV, targets_BxS)[0]


def _token_losses(x_BxSxE: jax.Array, w_ExV: jax.Array, targets_BxS: jax.Array):
    logits_BxSxV = unembed(x_BxSxE, w_ExV)
    logits = logits_BxSxV.astype(jnp.float32)
    lse_BxS = jax.nn.logsumexp(logits, axis=-1)
    # The target's logit as a masked sum, a reduction XLA fuses like the log-sum-exp. A
    # gather (take_along_axis) runs on TPU's SparseCores: from the float32 upcast it made
    # TPU materialize float32 logits; from the bf16 logits libtpu 0.0.42.1 fails to compile
    # it at qwen3-235b's shape (gather_emitter RET_CHECK on packed elements).
    target = jnp.sum(jnp.where(_is_target(logits, targets_BxS), logits, 0.0), axis=-1)
    return lse_BxS - target, (x_BxSxE, w_ExV, logits_BxSxV, targets_BxS, lse_BxS)


def _token_losses_grad(saved, g_BxS: jax.Array):
    """The unembedding's two gradient matmuls, each reading d loss / d logits made from the
    saved logits and log-sum-exp, the second after the first is done.

    A compiler fuses that elementwise gradient into each matmul (libtpu 0.0.42.1 does at
    llama3.1-70b's shape: no [batch, seq, vocab] gradient exists) or makes it in memory.
    libtpu 0.0.52 makes it, and made one copy per matmul, both live at once: 3.91 GiB per
    device more than MaxText's program at the 70B recipe. Made again after the first matmul
    (the barrier orders them), at most one is live; one shared copy instead would be made
    by both compilers, 3.91 GiB more in libtpu 0.0.42.1's program."""
    x_BxSxE, w_ExV, logits_BxSxV, targets_BxS, lse_BxS = saved
    dw_ExV = jax.lax.dot_general(
        x_BxSxE,
        _logits_grad(logits_BxSxV, targets_BxS, lse_BxS, g_BxS),
        (((0, 1), (0, 1)), ((), ())),
    )
    logits_BxSxV, dw_ExV = jax.lax.optimization_barrier((logits_BxSxV, dw_ExV))
    dx_BxSxE = jax.lax.dot_general(
        _logits_grad(logits_BxSxV, targets_BxS, lse_BxS, g_BxS), w_ExV, (((2,), (1,)), ((), ()))
    )
    return dx_BxSxE, dw_ExV, None


token_losses.defvjp(_token_losses, _token_losses_grad)


def _logits_grad(logits_BxSxV, targets_BxS, lse_BxS, g_BxS) -> jax.Array:
    """d loss / d logits = g * (softmax - one-hot(target)), in float32 from the bf16 logits and
    cast to their dtype once (the upcast's own gradient would do the same)."""
    softmax = jnp.exp(logits_BxSxV.astype(jnp.float32) - lse_BxS[..., None])
    one_hot = _is_target(logits_BxSxV, targets_BxS).astype(jnp.float32)
    grad = (g_BxS[..., None] * (softmax - one_hot)).astype(logits_BxSxV.dtype)
    return nn.with_logical_constraint(grad, LOGITS_AXES)


def _is_target(logits_BxSxV: jax.Array, targets_BxS: jax.Array) -> jax.Array:
    """[batch, seq, vocab] mask of each token's target (fused where it is used)."""
    vocab = jnp.arange(logits_BxSxV.shape[-1], dtype=targets_BxS.dtype)
    return vocab == targets_BxS[..., None]


def mean_cross_entropy(
    x_BxSxE: jax.Array, w_ExV: jax.Array, targets_BxS: jax.Array, tiles: int = 1
) -> jax.Array:
    """Mean token cross entropy of hidden states `x` under the unembedding `w`."""
    if tiles == 1:
        return token_losses(x_BxSxE, w_ExV, targets_BxS).mean()
    b, s, e = x_BxSxE.shape
    if s % tiles:
        raise ValueError(f"vocab_tiling {tiles} must divide seq_len {s}")
    x_TxBxCxE = x_BxSxE.reshape(b, tiles, s // tiles, e).swapaxes(0, 1)
    t_TxBxC = targets_BxS.reshape(b, tiles, s // tiles).swapaxes(0, 1)

    @jax.checkpoint  # saves nothing: the tile's logits are made again for the backward pass
    def tile_loss(x_BxCxE, t_BxC):
        return token_losses(x_BxCxE, w_ExV, t_BxC).sum()

    def body(total, tile):
        return total + tile_loss(*tile), None

    total, _ = jax.lax.scan(body, jnp.zeros((), jnp.float32), (x_TxBxCxE, t_TxBxC))
    return total / (b * s)
