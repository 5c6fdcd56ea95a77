"""The Flax model agrees with an independent pure-JAX implementation of the same maths."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from benchmarks.bare_loop import loss_fn
from tests.helpers import trial
from trainer.config import load_config
from trainer.data import BatchSource
from trainer.events import Emitter
from trainer.run import build_program, train


@pytest.mark.parametrize("model", ["tiny-dense", "tiny-moe"])
def test_flax_model_matches_hand_written_forward(model):
    config = load_config(trial(model, steps=1, num_devices=1, per_device_batch=4, mesh={"fsdp": 1}))
    program = build_program(config, jax.devices()[:1])
    params = program.init_fn(jax.random.key(config.seed)).params
    batch = BatchSource(config, program.global_batch, 1).batch(0)
    _, bare_ce = loss_fn(
        params, batch.inputs_BxS, batch.targets_BxS, batch.positions_BxS, config.model
    )
    trainer_loss = train(config, Emitter(quiet=True)).losses[0]
    assert trainer_loss == pytest.approx(float(bare_ce), rel=1e-4)


def test_logits_match_an_independent_reference_model():
    """The trainer's decoder against tests/reference_model.py (NumPy, no trainer code)."""
    import flax
    import jax.numpy as jnp

    from tests.reference_model import forward
    from trainer.config import ModelConfig
    from trainer.model import Transformer

    cfg = ModelConfig(preset="tiny-dense")
    model = Transformer(cfg, dtype=jnp.float32)
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 24))
    positions = np.broadcast_to(np.arange(24), tokens.shape)
    variables = model.init(jax.random.key(1), tokens, positions)
    logits, _ = model.apply(variables, tokens, positions)
    params = jax.tree.map(np.asarray, flax.core.meta.unbox(variables["params"]))
    want = forward(
        params, tokens, num_layers=cfg.num_layers, eps=cfg.norm_eps, theta=cfg.rope_theta
    )
    np.testing.assert_allclose(np.asarray(logits), want, rtol=2e-4, atol=2e-4)
