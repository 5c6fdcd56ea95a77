"""The load-balancing loss has its known value on constructed routings (Switch Transformer:
num_experts * sum_e fraction_routed_e * mean_prob_e, times the weight)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from trainer.model.moe import MoeBlock
from trainer.trial.config import KernelsConfig, ModelConfig

EXPERTS, WEIGHT, TOKENS, D = 4, 0.01, 16, 8


def _aux_loss(router: np.ndarray, x: np.ndarray, k: int = 1) -> float:
    cfg = ModelConfig(vocab_size=16, d_model=D, num_layers=1, num_heads=2, num_kv_heads=1,
                      head_dim=4, mlp_dim=8, num_experts=EXPERTS, experts_per_token=k,
                      load_balance_loss_weight=WEIGHT)  # fmt: skip
    block = MoeBlock(cfg, jnp.float32, KernelsConfig(), "cpu")
    params = block.init(jax.random.key(0), jnp.asarray(x))["params"]
    params = {**params, "router": jnp.asarray(router, jnp.float32)}
    _, aux = block.apply({"params": params}, jnp.asarray(x))
    return float(aux)


def _tokens(owner: np.ndarray) -> np.ndarray:
    """Token t is the unit vector of dimension owner[t] (one batch row)."""
    x = np.zeros((1, TOKENS, D), np.float32)
    x[0, np.arange(TOKENS), owner] = 1.0
    return x


def test_perfectly_balanced_confident_routing_costs_the_weight():
    # Dimension e routes to expert e with probability ~1; tokens spread evenly over experts:
    # fraction 1/4 and mean probability 1/4 each -> 4 * 4 * (1/16) * w = w.
    router = np.zeros((D, EXPERTS), np.float32)
    router[np.arange(EXPERTS), np.arange(EXPERTS)] = 50.0
    aux = _aux_loss(router, _tokens(np.arange(TOKENS) % EXPERTS))
    assert aux == pytest.approx(WEIGHT, rel=1e-4)


def test_collapsed_routing_costs_num_experts_times_the_weight():
    # Every token confidently to expert 0: fraction 1, mean probability 1 -> 4 * w.
    router = np.zeros((D, EXPERTS), np.float32)
    router[:, 0] = 50.0
    aux = _aux_loss(router, _tokens(np.arange(TOKENS) % D))
    assert aux == pytest.approx(EXPERTS * WEIGHT, rel=1e-4)


def test_uniform_probabilities_cost_the_weight_whatever_the_tie_break():
    # A zero router: every probability 1/4, so the loss is w however top-k breaks the tie.
    aux = _aux_loss(np.zeros((D, EXPERTS), np.float32), _tokens(np.arange(TOKENS) % D), k=2)
    assert aux == pytest.approx(WEIGHT, rel=1e-5)
