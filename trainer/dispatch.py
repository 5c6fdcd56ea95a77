"""Expert parallelism: send each token to the devices that hold its experts, and back.

Runs per device under shard_map over the whole mesh. Tokens are sharded over the batch
axes (which include `expert`) and `context`; expert weights over `expert`, their mlp
dimension over `tensor`. Each device sorts its (token, choice) slots by expert, sends every
expert shard its slots with one ragged all-to-all, runs its local experts as one grouped
matmul, and returns the results with a second ragged all-to-all. The receive buffer holds
the worst case (every peer routes every slot to this shard), so no token is ever dropped.

XLA:CPU has no ragged-all-to-all; there the same exchange is emulated with an all-gather,
following the documented semantics exactly, so CPU runs check the routing arithmetic.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

EXPERT, TENSOR = "expert", "tensor"

# Platforms whose XLA backend implements the ragged-all-to-all HLO.
NATIVE_RAGGED_A2A = ("tpu", "gpu")


def ragged_all_to_all(
    operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *, native: bool
):
    """jax.lax.ragged_all_to_all over the expert axis, or its emulation where XLA lacks it."""
    if native:
        return jax.lax.ragged_all_to_all(
            operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, axis_name=EXPERT
        )
    return emulated_ragged_all_to_all(
        operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, EXPERT
    )


def emulated_ragged_all_to_all(
    operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, axis_name
):
    """The semantics of jax.lax.ragged_all_to_all (one slice per peer) from an all-gather:
    the slice peer s sends here is operand_s[input_offsets_s[me] : + send_sizes_s[me]],
    written at output_offsets_s[me]. `recv_sizes` must agree with the peers' send sizes."""
    del recv_sizes  # implied by the peers' send_sizes; kept for the same signature
    me = jax.lax.axis_index(axis_name)
    operands = jax.lax.all_gather(operand, axis_name)
    starts, sizes, lands = (
        jax.lax.all_gather(a, axis_name)[:, me] for a in (input_offsets, send_sizes, output_offsets)
    )
    rows = jnp.arange(output.shape[0])
    result = output
    for peer in range(operands.shape[0]):
        inside = (rows >= lands[peer]) & (rows < lands[peer] + sizes[peer])
        source = jnp.clip(starts[peer] + rows - lands[peer], 0, operand.shape[0] - 1)
        taken = jnp.take(operands[peer], source, axis=0)
        result = jnp.where(inside.reshape(-1, *([1] * (output.ndim - 1))), taken, result)
    return result


def expert_parallel(
    x_BxSxE,
    top_i_BxSxK,
    top_w_BxSxK,
    weights,
    *,
    gmm: Callable,
    native: bool,
    tag: Callable = lambda x, name: x,
):
    """Per-device body: dispatch slots to expert shards, run local experts, combine."""
    wi_0, wi_1, wo = weights  # local: (L, E, F/tp), (L, E, F/tp), (L, F/tp, E)
    b, s, e = x_BxSxE.shape
    k = top_i_BxSxK.shape[-1]
    local = wi_0.shape[0]
    ep = jax.lax.axis_size(EXPERT)
    me = jax.lax.axis_index(EXPERT)
    slots = b * s * k

    expert_of_slot = top_i_BxSxK.reshape(slots)
    order = jnp.argsort(expert_of_slot, stable=True)
    x_sorted = jnp.take(x_BxSxE.reshape(b * s, e), order // k, axis=0)
    # counts[d, l]: my slots for local expert l of shard d. all_counts[src, dst, l].
    counts_DxL = jnp.bincount(expert_of_slot, length=ep * local).astype(jnp.int32)
    counts_DxL = counts_DxL.reshape(ep, local)
    all_counts = jax.lax.all_gather(counts_DxL, EXPERT)
    sizes_SxD = all_counts.sum(axis=2)
    send_offsets_SxD = jnp.cumsum(sizes_SxD, axis=1) - sizes_SxD  # in each source's sorted slots
    land_SxD = jnp.cumsum(sizes_SxD, axis=0) - sizes_SxD  # in each destination's buffer
    send_D, recv_S = sizes_SxD[me], sizes_SxD[:, me]

    buffer_rows = ep * slots
    received = ragged_all_to_all(
        x_sorted,
        jnp.zeros((buffer_rows, e), x_sorted.dtype),
        send_offsets_SxD[me],
        send_D,
        land_SxD[me],
        recv_S,
        native=native,
    )

    # The buffer holds, per source, its slots ordered by my local experts; regroup by expert.
    to_me_SxL = all_counts[:, me, :]
    total = jnp.sum(to_me_SxL)
    expert_ids = jnp.concatenate([jnp.tile(jnp.arange(local), ep), jnp.array([local])])
    repeats = jnp.concatenate([to_me_SxL.reshape(-1), (buffer_rows - total)[None]])
    row_expert = jnp.repeat(expert_ids, repeats, total_repeat_length=buffer_rows)
    regroup = jnp.argsort(row_expert, stable=True)
    h = jnp.take(received, regroup, axis=0)
    groups_L = to_me_SxL.sum(axis=0)
    # Rows past the received total belong to no group; keep them exactly zero so that no
    # kernel's unwritten rows can reach a gradient.
    valid = (jnp.arange(buffer_rows) < total)[:, None]
    gate = tag(gmm(h, wi_0, groups_L), "mlpwi_0")
    up = tag(gmm(h, wi_1, groups_L), "mlpwi_1")
    act = jnp.where(valid, jax.nn.silu(gate) * up, 0).astype(h.dtype)
    out = jnp.where(valid, tag(gmm(act, wo, groups_L), "mlpwo"), 0).astype(h.dtype)
    out_received = jnp.zeros_like(out).at[regroup].set(out)

    out_sorted = ragged_all_to_all(
        out_received,
        jnp.zeros((slots, e), out.dtype),
        land_SxD[:, me],
        recv_S,
        send_offsets_SxD[:, me],
        send_D,
        native=native,
    )
    out_TxKxE = jnp.zeros_like(out_sorted).at[order].set(out_sorted).reshape(b * s, k, e)
    y_TxE = jnp.einsum("tke,tk->te", out_TxKxE, top_w_BxSxK.reshape(b * s, k).astype(x_BxSxE.dtype))
    # The mlp dimension is split over `tensor`: each device holds a partial sum.
    if jax.lax.axis_size(TENSOR) > 1:
        y_TxE = jax.lax.psum(y_TxE, TENSOR)
    return y_TxE.reshape(b, s, e)
