"""Optimizer, train state and the pure train step."""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax import struct

from trainer.trial.config import TrialConfig


@struct.dataclass
class TrainState:
    step: jax.Array
    params: Any
    opt_state: Any
    model_state: Any  # collections other than params, e.g. qwix's quant_stats (static fp8 scales)


def make_optimizer(config: TrialConfig) -> optax.GradientTransformation:
    decay_steps = max(config.steps, config.warmup_steps + 1)
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=config.learning_rate,
        warmup_steps=config.warmup_steps,
        decay_steps=decay_steps,
        end_value=config.learning_rate * 0.1,
    )
    return optax.chain(
        optax.clip_by_global_norm(config.grad_clip),
        optax.adamw(
            schedule,
            b1=0.9,
            b2=0.95,
            weight_decay=config.weight_decay,
            mu_dtype=jnp.dtype(config.mu_dtype),
        ),
    )


def make_init_fn(
    model: nn.Module, tx: optax.GradientTransformation, config: TrialConfig, batch_shape
):
    """State init returning params still boxed with their logical axes (for eval_shape)."""

    def init_boxed(rng):
        tokens = jnp.zeros(batch_shape, jnp.int32)
        variables = dict(model.init(rng, tokens, tokens))
        params = variables.pop("params")
        return TrainState(
            step=jnp.zeros((), jnp.int32),
            params=params,
            opt_state=tx.init(params),
            model_state=variables,
        )

    return init_boxed


def make_train_step(model: nn.Module, tx: optax.GradientTransformation, config: TrialConfig):
    nan_at_step = config.fault.nan_at_step
    grad_scale = config.fault.grad_scale

    def train_step(state: TrainState, inputs, targets, positions):
        def loss_fn(params):
            variables = {"params": params, **state.model_state}
            if state.model_state:
                (ce, aux_loss), model_state = model.apply(
                    variables, inputs, positions, targets, mutable=list(state.model_state)
                )
            else:
                (ce, aux_loss), model_state = model.apply(variables, inputs, positions, targets), {}
            if nan_at_step is not None:
                ce = ce * jnp.where(state.step == nan_at_step, jnp.nan, 1.0)
            return ce + aux_loss, (ce, aux_loss, model_state)

        (_, (ce, aux_loss, model_state)), grads = jax.value_and_grad(loss_fn, has_aux=True)(
            state.params
        )
        if grad_scale != 1.0:
            grads = jax.tree.map(lambda g: g * grad_scale, grads)
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics = {"loss": ce, "aux_loss": aux_loss, "grad_norm": optax.global_norm(grads)}
        new_state = TrainState(
            step=state.step + 1, params=params, opt_state=opt_state, model_state=model_state
        )
        return new_state, metrics

    return train_step
