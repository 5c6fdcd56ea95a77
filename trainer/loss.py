"""The language-model loss over the vocabulary, whole or in tiles.

With `vocab_tiling` 1 the [batch, seq, vocab] logits exist in full (float32, as MaxText's
`cast_logits_to_fp32`). With N > 1 (MaxText's `num_vocab_tiling`) the tokens are split
into N tiles along the sequence; each tile's logits are made, reduced to its loss and
dropped, and made again in the backward pass (jax.checkpoint), so only one tile's logits
is ever live. The cost is one more unembedding matmul per step.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

LOGITS_AXES = ("activation_batch", "activation_length", "activation_vocab")


def unembed(x_BxSxE: jax.Array, w_ExV: jax.Array) -> jax.Array:
    """float32 logits, sharded like MaxText's (batch, length, vocab)."""
    logits = jax.lax.dot_general(x_BxSxE, w_ExV, (((2,), (0,)), ((), ()))).astype(jnp.float32)
    return nn.with_logical_constraint(logits, LOGITS_AXES)


def token_losses(logits_BxSxV: jax.Array, targets_BxS: jax.Array) -> jax.Array:
    """Cross entropy of each token: log-sum-exp of its logits minus its target's logit."""
    target = jnp.take_along_axis(logits_BxSxV, targets_BxS[..., None], axis=-1)[..., 0]
    return jax.nn.logsumexp(logits_BxSxV, axis=-1) - target


def mean_cross_entropy(
    x_BxSxE: jax.Array, w_ExV: jax.Array, targets_BxS: jax.Array, tiles: int = 1
) -> jax.Array:
    """Mean token cross entropy of hidden states `x` under the unembedding `w`."""
    if tiles == 1:
        return token_losses(unembed(x_BxSxE, w_ExV), targets_BxS).mean()
    b, s, e = x_BxSxE.shape
    if s % tiles:
        raise ValueError(f"vocab_tiling {tiles} must divide seq_len {s}")
    x_TxBxCxE = x_BxSxE.reshape(b, tiles, s // tiles, e).swapaxes(0, 1)
    t_TxBxC = targets_BxS.reshape(b, tiles, s // tiles).swapaxes(0, 1)

    @jax.checkpoint  # saves nothing: the tile's logits are made again for the backward pass
    def tile_loss(x_BxCxE, t_BxC):
        return token_losses(unembed(x_BxCxE, w_ExV), t_BxC).sum()

    def body(total, tile):
        return total + tile_loss(*tile), None

    total, _ = jax.lax.scan(body, jnp.zeros((), jnp.float32), (x_TxBxCxE, t_TxBxC))
    return total / (b * s)
