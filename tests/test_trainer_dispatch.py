"""Expert-parallel token dispatch (ragged all-to-all) against single-device routing."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from trainer.model.dispatch import (
    emulated_ragged_all_to_all,
    expert_parallel,
    local_experts,
    take_slots,
)
from trainer.model.grouped_matmul import grouped_matmul
from trainer.parallel.sharding import build_mesh
from trainer.trial.config import BATCH_AXES, KernelsConfig


def _ragged_a2a_on(devices: int, per_device: dict[str, list]) -> np.ndarray:
    mesh = jax.make_mesh((devices,), ("expert",), devices=jax.devices()[:devices])
    args = [
        jax.device_put(jnp.asarray(np.concatenate(v)), NamedSharding(mesh, P("expert")))
        for v in per_device.values()
    ]
    body = functools.partial(emulated_ragged_all_to_all, axis_name="expert")
    run = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("expert"), out_specs=P("expert")))
    return np.asarray(run(*args)).reshape(devices, -1)


def test_emulated_ragged_all_to_all_reproduces_the_documented_example():
    # The example in jax.lax.ragged_all_to_all's docstring (axis of size 2).
    result = _ragged_a2a_on(
        2,
        {
            "operand": [[1, 2, 2], [3, 4, 0]],
            "output": [[0, 0, 0, 0], [0, 0, 0, 0]],
            "input_offsets": [[0, 1], [0, 1]],
            "send_sizes": [[1, 2], [1, 1]],
            "output_offsets": [[0, 0], [1, 2]],
            "recv_sizes": [[1, 1], [2, 1]],
        },
    )
    np.testing.assert_array_equal(result, [[1, 3, 0, 0], [2, 2, 4, 0]])


def test_emulated_ragged_all_to_all_matches_the_documented_pseudocode():
    """Random ragged exchanges on 4 devices against the docstring's SEND/RECEIVE loop."""
    rng = np.random.default_rng(0)
    n, rows = 4, 12
    sizes = rng.integers(0, 4, size=(n, n))  # sizes[src, dst]
    operand = rng.normal(size=(n, rows)).astype(np.float32)
    input_offsets = np.cumsum(sizes, axis=1) - sizes
    output_offsets = np.cumsum(sizes, axis=0) - sizes  # where src lands on dst
    expected = np.full((n, rows), -1.0, np.float32)
    for src in range(n):
        for dst in range(n):
            s, o, size = input_offsets[src, dst], output_offsets[src, dst], sizes[src, dst]
            expected[dst, o : o + size] = operand[src, s : s + size]
    result = _ragged_a2a_on(
        n,
        {
            "operand": list(operand),
            "output": [np.full(rows, -1.0, np.float32)] * n,
            "input_offsets": list(input_offsets.astype(np.int32)),
            "send_sizes": list(sizes.astype(np.int32)),
            "output_offsets": list(output_offsets.astype(np.int32)),
            "recv_sizes": list(sizes.T.astype(np.int32)),
        },
    )
    np.testing.assert_array_equal(result, expected)


def _moe_inputs(n_experts: int, k: int, routing: str):
    rng = np.random.default_rng(1)
    b, s, e, f = 8, 16, 32, 64
    x = rng.normal(size=(b, s, e)).astype(np.float32)
    if routing == "one_expert":  # worst case: every slot of every device to shard 0
        top_i = np.zeros((b, s, k), np.int32)
        top_i[..., 1:] = 1
    else:
        top_i = np.stack([rng.permutation(n_experts)[:k] for _ in range(b * s)]).reshape(b, s, k)
    top_w = rng.uniform(size=(b, s, k)).astype(np.float32)
    weights = tuple(
        rng.normal(size=shape).astype(np.float32) * 0.1
        for shape in ((n_experts, e, f), (n_experts, e, f), (n_experts, f, e))
    )
    return jnp.asarray(x), jnp.asarray(top_i.astype(np.int32)), jnp.asarray(top_w), weights


@pytest.mark.parametrize(
    "routing,gmm_impl,degrees,capacity",
    [
        ("random", "ragged_dot", {"expert": 4, "tensor": 2}, -1.0),
        ("one_expert", "ragged_dot", {"expert": 8}, -1.0),
        ("random", "megablox", {"expert": 2, "fsdp": 4}, -1.0),
        ("random", "ragged_dot", {"expert": 4, "tensor": 2}, 1.0),
        ("one_expert", "ragged_dot", {"expert": 8}, 2.0),
    ],
)
def test_expert_parallel_dispatch_equals_single_device_routing(
    routing, gmm_impl, degrees, capacity
):
    """Outputs and gradients (tokens and expert weights) of the sharded dispatch equal each
    device group routed on one device: dropless, with every slot sent to one shard, and with
    a capacity that drops slots."""
    full = {"data": 1, "fsdp": 1, "context": 1, "expert": 1, "tensor": 1, **degrees}
    mesh = build_mesh(full, jax.devices()[:8])
    kernels = KernelsConfig(moe_gmm=gmm_impl, gmm_tm=32, gmm_tk=32, gmm_tn=32)
    gmm = functools.partial(grouped_matmul, kernels=kernels, interpret=True)
    x, top_i, top_w, weights = _moe_inputs(8, 2, routing)
    tokens = P(BATCH_AXES, "context", None)
    w_in, w_out = P("expert", None, "tensor"), P("expert", "tensor", None)
    sharded = jax.shard_map(
        functools.partial(expert_parallel, gmm=gmm, native=False, capacity_factor=capacity),
        mesh=mesh,
        in_specs=(tokens, tokens, tokens, (w_in, w_in, w_out)),
        out_specs=tokens,
        check_vma=False,
    )
    groups = full["data"] * full["fsdp"] * full["expert"]  # batch shards; context is 1 here

    def reference(x, top_i, top_w, w):
        # Capacity is per device token group: route each group on its own.
        route = functools.partial(local_experts, gmm=gmm, capacity_factor=capacity)
        parts = zip(*(jnp.split(a, groups) for a in (x, top_i, top_w)), strict=True)
        return jnp.concatenate([route(*part, w) for part in parts])

    cot = jnp.asarray(np.random.default_rng(2).normal(size=x.shape).astype(np.float32))

    def loss(fn, x, w):
        return jnp.sum(fn(x, top_i, top_w, w) * cot)

    with jax.set_mesh(mesh):
        got, got_grads = jax.jit(jax.value_and_grad(functools.partial(loss, sharded), (0, 1)))(
            x, weights
        )
    want, want_grads = jax.value_and_grad(functools.partial(loss, reference), (0, 1))(x, weights)
    np.testing.assert_allclose(got, want, rtol=1e-4)
    for g, w in zip(jax.tree.leaves(got_grads), jax.tree.leaves(want_grads), strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-4)


def test_capacity_keeps_the_first_slots_of_an_overloaded_expert():
    x, top_i, top_w, weights = _moe_inputs(8, 2, "one_expert")  # choice 0 -> expert 0
    top_w = top_w.at[..., 1].set(0.0)  # look at expert 0's contribution only
    gmm = functools.partial(grouped_matmul, kernels=KernelsConfig(), interpret=True)
    tokens = x.shape[0] * x.shape[1]
    dropless = local_experts(x, top_i, top_w, weights, gmm=gmm).reshape(tokens, -1)
    capped = local_experts(x, top_i, top_w, weights, gmm=gmm, capacity_factor=1.0)
    capped = capped.reshape(tokens, -1)
    # ceil(1.0 x slots / experts) = tokens * 2 / 8 slots kept, the earliest tokens first.
    kept = tokens * 2 // 8
    np.testing.assert_allclose(capped[:kept], dropless[:kept], rtol=1e-5)
    assert np.all(np.asarray(capped[kept:]) == 0) and np.all(np.abs(dropless[kept:]) > 0)


@pytest.mark.parametrize("k", [1, 3])
def test_slot_gathers_differentiate_as_the_gather_and_scatter_they_replace(k):
    """take_slots is x[order // k] (k = 1: a permutation) with a gradient that gathers by
    the inverse order and sums each token's slots: the same values and gradients as
    autodiff of jnp.take, and of the scatter that unsorted slot outputs before."""
    rng = np.random.default_rng(k)
    tokens, d = 16, 5
    x = jnp.asarray(rng.normal(size=(tokens, d)), jnp.float32)
    order = jnp.asarray(rng.permutation(tokens * k))
    inverse = jnp.argsort(order)
    w = jnp.asarray(rng.normal(size=(tokens * k, d)), jnp.float32)

    def ours(x):
        return jnp.sum(take_slots(x, order, inverse, k) * w)

    def autodiff(x):
        return jnp.sum(jnp.take(x, order // k, axis=0) * w)

    assert ours(x) == autodiff(x)
    np.testing.assert_allclose(jax.grad(ours)(x), jax.grad(autodiff)(x), rtol=1e-6, atol=1e-6)
    y = jnp.asarray(rng.normal(size=(tokens * k, d)), jnp.float32)

    def unsorted(y):
        return jnp.sum(take_slots(y, inverse, order, 1) * w)

    def scattered(y):
        return jnp.sum(jnp.zeros_like(y).at[order].set(y) * w)

    assert unsorted(y) == scattered(y)
    np.testing.assert_array_equal(jax.grad(unsorted)(y), jax.grad(scattered)(y))
