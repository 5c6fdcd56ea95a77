"""Context parallelism's causal load balancing: the sequence in 2 x context chunks, device i
holding chunks i and 2 x context - 1 - i, so causal attention work is even."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np


def load_balance_order(seq_len: int, context: int) -> np.ndarray:
    """Causal load balancing: 2*cp chunks, device i holds chunks i and 2*cp-1-i."""
    chunks = np.arange(seq_len).reshape(2 * context, -1)
    pairs = [np.concatenate([chunks[i], chunks[2 * context - 1 - i]]) for i in range(context)]
    return np.concatenate(pairs)


def natural_chunk_order(x_BxSx___, context: int):
    """Undo the load-balancing permutation along axis 1 (trainer.run.data.load_balance_order):
    chunk pairs (i, 2c-1-i) back to chunks 0..2c-1, by static slices."""
    chunks = jnp.split(x_BxSx___, 2 * context, axis=1)  # [0, 2c-1, 1, 2c-2, ...]
    first, second = chunks[0::2], chunks[1::2]
    return jnp.concatenate(first + second[::-1], axis=1)
