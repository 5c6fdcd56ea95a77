"""The Flax model agrees with an independent pure-JAX implementation of the same maths."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from benchmarks.bare_loop import loss_fn
from tests.helpers import trial
from trainer.program.build import build_program
from trainer.run.data import BatchSource
from trainer.run.train import train
from trainer.trial.config import load_config
from trainer.trial.events import Emitter

SHARED = {"shared_experts": 2, "shared_mlp_dim": 48}  # a shared MLP 96 wide beside 4 experts


@pytest.mark.parametrize(
    ("model", "shape"),
    [("tiny-dense", {}), ("tiny-moe", {}), ("tiny-moe", SHARED)],
    ids=["dense", "moe", "moe-shared"],
)
def test_flax_model_matches_hand_written_forward(model, shape):
    base = trial(model, steps=1, num_devices=1, per_device_batch=4, mesh={"fsdp": 1})
    config = load_config({**base, "model": {**base["model"], **shape}})
    program = build_program(config, jax.devices()[:1])
    params = program.init_fn(jax.random.key(config.seed)).params
    batch = BatchSource(config, program.global_batch, 1).batch(0)
    _, bare_ce = loss_fn(
        params, batch.inputs_BxS, batch.targets_BxS, batch.positions_BxS, config.model
    )
    trainer_loss = train(config, Emitter(quiet=True)).losses[0]
    assert trainer_loss == pytest.approx(float(bare_ce), rel=1e-4)
    if shape:  # the shared experts' MLP, at its width, in every layer
        shared = params["layers"]["shared_mlp"]
        assert shared["wi_0"].shape == (config.model.num_layers, config.model.d_model, 96)


@pytest.mark.parametrize("qk_norm", [False, True])
def test_logits_match_an_independent_reference_model(qk_norm):
    """The trainer's decoder against tests/reference_model.py (NumPy, no trainer code); with
    QK-norm, its scales drawn at random so that leaving them out shows."""
    import flax
    import jax.numpy as jnp

    from tests.reference_model import forward
    from trainer.model.transformer import Transformer
    from trainer.trial.config import ModelConfig

    cfg = ModelConfig(preset="tiny-dense", qk_norm=qk_norm)
    model = Transformer(cfg, dtype=jnp.float32)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, cfg.vocab_size, (2, 24))
    positions = np.broadcast_to(np.arange(24), tokens.shape)
    variables = flax.core.meta.unbox(model.init(jax.random.key(1), tokens, positions))
    if qk_norm:
        attention = variables["params"]["layers"]["attention"]
        for name in ("query_norm", "key_norm"):
            scale = attention[name]["scale"]
            attention[name]["scale"] = jnp.asarray(rng.uniform(0.5, 2.0, scale.shape), scale.dtype)
    logits, _ = model.apply(variables, tokens, positions)
    params = jax.tree.map(np.asarray, variables["params"])
    want = forward(
        params, tokens, num_layers=cfg.num_layers, eps=cfg.norm_eps, theta=cfg.rope_theta
    )
    np.testing.assert_allclose(np.asarray(logits), want, rtol=2e-4, atol=2e-4)
