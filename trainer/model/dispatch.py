"""Routing (token, choice) slots through the experts: on one device, or across devices.

`local_experts` routes a device's slots through all experts it holds. `expert_parallel`
runs per device under shard_map over the whole mesh. Tokens are sharded over the batch
axes (which include `expert`) and `context`; expert weights over `expert`, their mlp
dimension over `tensor`. Each device sorts its (token, choice) slots by expert, sends every
expert shard its slots with one ragged all-to-all, runs its local experts as one grouped
matmul, and returns the results with a second ragged all-to-all. The receive buffer holds
the worst case (every peer routes every slot to this shard), so no token is dropped.

With `capacity_factor` > 0 each expert accepts at most ceil(factor x slots / experts)
slots from one device's token group (MaxText's capacity semantics: earlier slots first);
the rest are dropped (their expert output is zero, the residual carries the token), and
the expert-parallel receive buffer shrinks to about factor x slots.

XLA:CPU has no ragged-all-to-all; there the same exchange is emulated with an all-gather,
following the documented semantics exactly, so CPU runs check the routing arithmetic.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp

from trainer.trial.capacity import expert_capacity, receive_buffer_groups
from trainer.trial.remat import Tensor

EXPERT, TENSOR = "expert", "tensor"

# Platforms whose XLA backend implements the ragged-all-to-all HLO.


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


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def take_slots(x_TxE, order, inverse, k: int):
    """Row `order[i] // k` of x for each i: the rows of slots in `order`, a permutation of
    the T*k (token, choice) slots (slot t*k + j is token t's j-th; k = 1: a permutation of
    x's rows), `inverse` its inverse. Its gradient gathers too, by `inverse`, summing each
    token's k slots, where XLA would scatter-add: TPU scatters 16-bit rows through 32-bit
    buffers (a [slots, d_model] gradient at twice its bytes)."""
    return jnp.take(x_TxE, order // k, axis=0)


def _take_slots_fwd(x_TxE, order, inverse, k):
    return take_slots(x_TxE, order, inverse, k), inverse


def _take_slots_bwd(k, inverse, g_SxE):
    g_TxKxE = jnp.take(g_SxE, inverse, axis=0).reshape(-1, k, g_SxE.shape[-1])
    return jnp.sum(g_TxKxE, axis=1, dtype=jnp.float32).astype(g_SxE.dtype), None, None


take_slots.defvjp(_take_slots_fwd, _take_slots_bwd)


def sort_slots(expert_of_slot, num_experts: int, capacity: int | None):
    """Order putting kept slots first, grouped by expert (stable), dropped slots last; and the
    kept count of each expert."""
    counts = jnp.bincount(expert_of_slot, length=num_experts).astype(jnp.int32)
    order = jnp.argsort(expert_of_slot, stable=True)
    if capacity is None:
        return order, counts
    expert_sorted = expert_of_slot[order]
    rank = jnp.arange(expert_of_slot.shape[0]) - (jnp.cumsum(counts) - counts)[expert_sorted]
    key = jnp.where(rank < capacity, expert_sorted, num_experts)
    return order[jnp.argsort(key, stable=True)], jnp.minimum(counts, capacity)


def sorted_slots(x_BxSxE, top_i_BxSxK, num_experts: int, capacity_factor: float):
    """This group's token rows, one per (token, choice) slot, in `sort_slots` order; the
    order, its inverse and the kept count of each expert."""
    b, s, e = x_BxSxE.shape
    k = top_i_BxSxK.shape[-1]
    capacity = expert_capacity(b * s * k, num_experts, capacity_factor)
    order, counts = sort_slots(top_i_BxSxK.reshape(b * s * k), num_experts, capacity)
    inverse = jnp.argsort(order)
    x_sorted = take_slots(x_BxSxE.reshape(b * s, e), order, inverse, k)
    return x_sorted, order, inverse, counts


def expert_mlp(h_MxE, weights, group_sizes, rows_used, gmm: Callable, tag: Callable):
    """SwiGLU experts as grouped matmuls over sorted rows. Rows past `rows_used` belong to no
    group; they are kept exactly zero so that no kernel's unwritten rows reach a gradient."""
    wi_0, wi_1, wo = weights
    valid = (jnp.arange(h_MxE.shape[0]) < rows_used)[:, None]
    gate = tag(gmm(h_MxE, wi_0, group_sizes, weight="wi"), Tensor.MLPWI_0)
    up = tag(gmm(h_MxE, wi_1, group_sizes, weight="wi"), Tensor.MLPWI_1)
    act = jnp.where(valid, jax.nn.silu(gate) * up, 0).astype(h_MxE.dtype)
    return jnp.where(valid, tag(gmm(act, wo, group_sizes, weight="wo"), Tensor.MLPWO), 0).astype(
        h_MxE.dtype
    )


def combine(out_sorted, order, inverse, top_w_BxSxK, dtype):
    """Unsort slot outputs and mix each token's k expert outputs by router weight."""
    b, s, k = top_w_BxSxK.shape
    out_TxKxE = take_slots(out_sorted, inverse, order, 1).reshape(b * s, k, -1)
    y_TxE = jnp.einsum("tke,tk->te", out_TxKxE, top_w_BxSxK.reshape(b * s, k).astype(dtype))
    return y_TxE.reshape(b, s, -1)


def local_experts(
    x_BxSxE,
    top_i_BxSxK,
    top_w_BxSxK,
    weights,
    *,
    gmm: Callable,
    capacity_factor: float = -1.0,
    tag: Callable = lambda x, name: x,
):
    """Every slot of this token group through the experts held here (all of them)."""
    n = weights[0].shape[0]
    x_sorted, order, inverse, counts = sorted_slots(x_BxSxE, top_i_BxSxK, n, capacity_factor)
    out_sorted = expert_mlp(x_sorted, weights, counts, jnp.sum(counts), gmm, tag)
    return combine(out_sorted, order, inverse, top_w_BxSxK, x_BxSxE.dtype)


def expert_parallel(
    x_BxSxE,
    top_i_BxSxK,
    top_w_BxSxK,
    weights,
    *,
    gmm: Callable,
    native: bool,
    capacity_factor: float = -1.0,
    tag: Callable = lambda x, name: x,
):
    """Per-device body: dispatch slots to expert shards, run local experts, combine."""
    # weights here: wi_0, wi_1 (L, E, F/tp) and wo (L, F/tp, E) for the L local experts
    local = weights[0].shape[0]
    ep = jax.lax.axis_size(EXPERT)
    me = jax.lax.axis_index(EXPERT)
    x_sorted, order, inverse, counts = sorted_slots(
        x_BxSxE, top_i_BxSxK, ep * local, capacity_factor
    )
    slots, e = x_sorted.shape
    # counts[d, l]: my kept slots for local expert l of shard d. all_counts[src, dst, l].
    counts_DxL = counts.reshape(ep, local)
    all_counts = jax.lax.all_gather(counts_DxL, EXPERT)
    sizes_SxD = all_counts.sum(axis=2)
    send_offsets_SxD = jnp.cumsum(sizes_SxD, axis=1) - sizes_SxD  # in each source's sorted slots
    land_SxD = jnp.cumsum(sizes_SxD, axis=0) - sizes_SxD  # in each destination's buffer
    send_D, recv_S = sizes_SxD[me], sizes_SxD[:, me]

    buffer_rows = receive_buffer_groups(slots, ep * local, ep, capacity_factor) * slots
    received = ragged_all_to_all(
        x_sorted,
        jnp.zeros((buffer_rows, e), x_sorted.dtype),
        send_offsets_SxD[me],
        send_D,
        land_SxD[me],
        recv_S,
        native=native,
    )

    out_received = _local_experts(received, all_counts[:, me, :], weights, gmm, tag)

    out_sorted = ragged_all_to_all(
        out_received,
        jnp.zeros((slots, e), out_received.dtype),
        land_SxD[:, me],
        recv_S,
        send_offsets_SxD[:, me],
        send_D,
        native=native,
    )
    y_BxSxE = combine(out_sorted, order, inverse, top_w_BxSxK, x_BxSxE.dtype)
    # The mlp dimension is split over `tensor`: each device holds a partial sum.
    if jax.lax.axis_size(TENSOR) > 1:
        y_BxSxE = jax.lax.psum(y_BxSxE, TENSOR)
    return y_BxSxE


def _local_experts(received, to_me_SxL, weights, gmm: Callable, tag: Callable):
    """My local experts over the rows every source sent me: the buffer holds, per source, its
    slots ordered by my local experts (then padding); regrouped by expert, run, and put back
    in the buffer's order."""
    ep, local = to_me_SxL.shape
    buffer_rows = received.shape[0]
    total = jnp.sum(to_me_SxL)
    expert_ids = jnp.concatenate([jnp.tile(jnp.arange(local), ep), jnp.array([local])])
    repeats = jnp.concatenate([to_me_SxL.reshape(-1), (buffer_rows - total)[None]])
    row_expert = jnp.repeat(expert_ids, repeats, total_repeat_length=buffer_rows)
    regroup = jnp.argsort(row_expert, stable=True)
    ungroup = jnp.argsort(regroup)
    h = take_slots(received, regroup, ungroup, 1)
    groups_L = to_me_SxL.sum(axis=0)
    out = expert_mlp(h, weights, groups_L, total, gmm, tag)
    return take_slots(out, ungroup, regroup, 1)
