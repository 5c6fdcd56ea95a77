"""Mixture-of-Experts block: top-k router, dropless grouped matmul, load-balancing loss."""

from __future__ import annotations

import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

from trainer.model.dispatch import expert_parallel, local_experts
from trainer.model.grouped_matmul import grouped_matmul
from trainer.trial.config import BATCH_AXES, KernelsConfig, ModelConfig, PrecisionConfig
from trainer.trial.effects import NATIVE_RAGGED_A2A
from trainer.trial.remat import Tensor, moe_twin


def _tag(x, tensor: Tensor):
    # Expert tensors answer to both the dense name and its moe_ twin, as in MaxText.
    return checkpoint_name(checkpoint_name(x, tensor), moe_twin(tensor))


class MoeBlock(nn.Module):
    cfg: ModelConfig
    dtype: Any
    kernels: KernelsConfig
    platform: str
    fp8: PrecisionConfig | None = (
        None  # fp8 experts in tokamax's kernels (trainer/model/fp8_gmm.py)
    )

    @nn.compact
    def __call__(self, x_BxSxE):
        cfg, dt = self.cfg, self.dtype
        b, s, e = x_BxSxE.shape
        n, k, f = cfg.num_experts, cfg.experts_per_token, cfg.mlp_dim
        init = nn.initializers.normal
        router = self.param(
            "router",
            nn.with_logical_partitioning(init(e**-0.5), ("embed", None)),
            (e, n),
            jnp.float32,
        )
        wi_0 = self.param(
            "wi_0", nn.with_logical_partitioning(init(e**-0.5), ("exp", "embed", "mlp")), (n, e, f)
        )
        wi_1 = self.param(
            "wi_1", nn.with_logical_partitioning(init(e**-0.5), ("exp", "embed", "mlp")), (n, e, f)
        )
        wo = self.param(
            "wo", nn.with_logical_partitioning(init(f**-0.5), ("exp", "mlp", "embed")), (n, f, e)
        )

        probs_BxSxN = jax.nn.softmax(
            jnp.einsum("bse,en->bsn", x_BxSxE.astype(jnp.float32), router), axis=-1
        )
        top_w_BxSxK, top_i_BxSxK = jax.lax.top_k(probs_BxSxN, k)
        top_w_BxSxK = top_w_BxSxK / jnp.sum(top_w_BxSxK, axis=-1, keepdims=True)

        weights = (wi_0.astype(dt), wi_1.astype(dt), wo.astype(dt))
        y_BxSxE = self._route(x_BxSxE, top_i_BxSxK, top_w_BxSxK, weights)

        # Switch-style balance loss: num_experts * sum_e(fraction routed to e * mean prob of e).
        tokens = b * s
        group_sizes = jnp.bincount(top_i_BxSxK.reshape(tokens * k), length=n)
        fraction_N = group_sizes.astype(jnp.float32) / (tokens * k)
        mean_prob_N = jnp.mean(probs_BxSxN, axis=(0, 1))
        aux_loss = n * jnp.sum(fraction_N * mean_prob_N) * cfg.load_balance_loss_weight
        return y_BxSxE, aux_loss

    def _route(self, x_BxSxE, top_i_BxSxK, top_w_BxSxK, weights):
        interpret = self.platform != "tpu"
        gmm = functools.partial(
            grouped_matmul,
            kernels=self.kernels,
            interpret=interpret,
            platform=self.platform,
            fp8=self.fp8,
        )
        common = {"gmm": gmm, "capacity_factor": self.cfg.capacity_factor, "tag": _tag}
        mesh = jax.sharding.get_abstract_mesh()
        if mesh.empty:
            return local_experts(x_BxSxE, top_i_BxSxK, top_w_BxSxK, weights, **common)
        if mesh.shape["expert"] > 1:
            # Expert parallelism: tokens travel to their experts' devices (all-to-all).
            body = functools.partial(
                expert_parallel, native=self.platform in NATIVE_RAGGED_A2A, **common
            )
            experts = "expert"
        else:
            # Each device routes its own tokens through every expert (per-device sort and
            # grouped matmul: no global slot order, buffers of the device's share); expert
            # weights arrive whole over the batch axes, as FSDP gathers any weight.
            body = functools.partial(per_device_experts, **common)
            experts = None
        tokens_spec = P(BATCH_AXES, "context", None)
        w_in, w_out = P(experts, None, "tensor"), P(experts, "tensor", None)
        return jax.shard_map(
            body,
            mesh=mesh,
            in_specs=(tokens_spec, tokens_spec, tokens_spec, (w_in, w_in, w_out)),
            out_specs=tokens_spec,
            check_vma=False,
        )(x_BxSxE, top_i_BxSxK, top_w_BxSxK, weights)


def per_device_experts(x_BxSxE, top_i_BxSxK, top_w_BxSxK, weights, **common):
    """One device's tokens through all experts; the mlp dimension is split over `tensor`, so
    each device holds a partial sum of the output."""
    y_BxSxE = local_experts(x_BxSxE, top_i_BxSxK, top_w_BxSxK, weights, **common)
    if jax.lax.axis_size("tensor") > 1:
        y_BxSxE = jax.lax.psum(y_BxSxE, "tensor")
    return y_BxSxE
