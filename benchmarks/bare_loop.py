"""A minimal hand-written pure-JAX training loop of the trainer's model (no Flax, no mesh).

It reads the same parameter tree the Flax model creates, so both do the same FLOPs; the
benchmark times it against the trainer, and a test checks both compute the same loss.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from trainer.model.attention import reference_attention as causal_attention
from trainer.model.transformer import apply_rope
from trainer.trial.config import ModelConfig

BF16 = jnp.bfloat16


def _rms(x, scale, eps):
    x32 = x.astype(jnp.float32)
    return (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, -1, keepdims=True) + eps) * scale).astype(BF16)


def _moe(p, x, cfg: ModelConfig):
    b, s, e = x.shape
    k = cfg.experts_per_token
    probs = jax.nn.softmax(x.astype(jnp.float32) @ p["router"], axis=-1)
    top_w, top_i = jax.lax.top_k(probs, k)
    top_w = top_w / top_w.sum(-1, keepdims=True)
    flat = top_i.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    xs = x.reshape(b * s, e)[order // k]
    sizes = jnp.bincount(flat, length=cfg.num_experts).astype(jnp.int32)
    h = jax.nn.silu(jax.lax.ragged_dot(xs, p["wi_0"].astype(BF16), sizes)) * jax.lax.ragged_dot(
        xs, p["wi_1"].astype(BF16), sizes
    )
    out = (
        jnp.zeros((b * s * k, e), BF16)
        .at[order]
        .set(jax.lax.ragged_dot(h, p["wo"].astype(BF16), sizes))
    )
    y = jnp.einsum("tke,tk->te", out.reshape(b * s, k, e), top_w.reshape(b * s, k).astype(BF16))
    aux = (
        cfg.num_experts
        * jnp.sum(sizes / (b * s * k) * probs.mean((0, 1)))
        * cfg.load_balance_loss_weight
    )
    return y.reshape(b, s, e), aux


def _layer(cfg: ModelConfig, x, p, positions):
    a = p["attention"]
    h = _rms(x, p["attn_norm"]["scale"], cfg.norm_eps)
    q = apply_rope(
        jnp.einsum("bse,ehd->bshd", h, a["query"].astype(BF16)), positions, cfg.rope_theta
    )
    k = apply_rope(jnp.einsum("bse,ehd->bshd", h, a["key"].astype(BF16)), positions, cfg.rope_theta)
    v = jnp.einsum("bse,ehd->bshd", h, a["value"].astype(BF16))
    ctx = causal_attention(q, k, v, positions, positions)
    x = x + jnp.einsum("bshd,hde->bse", ctx, a["out"].astype(BF16))
    h = _rms(x, p["mlp_norm"]["scale"], cfg.norm_eps)
    if cfg.is_moe:
        y, aux = _moe(p["moe"], h, cfg)
        if cfg.shared_width:  # the shared experts: a dense MLP beside the routed ones
            y = y + _mlp(p["shared_mlp"], h)
    else:
        y, aux = _mlp(p["mlp"], h), jnp.zeros((), jnp.float32)
    return x + y, aux


def _mlp(m, h):
    hidden = jax.nn.silu(h @ m["wi_0"].astype(BF16)) * (h @ m["wi_1"].astype(BF16))
    return hidden @ m["wo"].astype(BF16)


def loss_fn(params, inputs, targets, positions, cfg: ModelConfig):
    x = jnp.take(params["embedding"].astype(BF16), inputs, axis=0)
    body = jax.checkpoint(lambda x, p: _layer(cfg, x, p, positions), prevent_cse=False)
    x, aux = jax.lax.scan(body, x, params["layers"])
    x = _rms(x, params["final_norm"]["scale"], cfg.norm_eps)
    logits = jnp.einsum("bse,ev->bsv", x, params["unembed"].astype(BF16)).astype(jnp.float32)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()
    return ce + aux.sum(), ce


def make_step(cfg: ModelConfig, tx: optax.GradientTransformation):
    @jax.jit
    def step(params, opt_state, inputs, targets, positions):
        (_, ce), grads = jax.value_and_grad(loss_fn, has_aux=True)(
            params, inputs, targets, positions, cfg
        )
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, ce

    return step
