"""Decoder-only transformer (RMSNorm, RoPE, GQA, SwiGLU) with a scanned, rematted layer stack;
QK-norm (Qwen3) and mixture-of-experts layers, with shared experts beside the routed ones,
where the config asks for them."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from trainer.model.attention import fused_attention, reference_attention
from trainer.model.loss import mean_cross_entropy
from trainer.model.loss import unembed as output_logits
from trainer.model.moe import MoeBlock
from trainer.trial.config import KernelsConfig, ModelConfig, PrecisionConfig
from trainer.trial.remat import Tensor

Dtype = Any
ACT_BxSxE = ("activation_batch", "activation_length", None)


def dense(x, w, contract: int = 1):
    """x's last `contract` axes times w's first ones, as lax.dot_general: the op qwix's fp8 rule targets."""
    dims = ((tuple(range(x.ndim - contract, x.ndim)), tuple(range(contract))), ((), ()))
    return jax.lax.dot_general(x, w, dims)


def weight(
    module: nn.Module, name: str, shape: tuple[int, ...], axes: tuple[str | None, ...], fan_in: int
):
    init = nn.initializers.normal(stddev=fan_in**-0.5)
    return module.param(name, nn.with_logical_partitioning(init, axes), shape, jnp.float32)


class RMSNorm(nn.Module):
    eps: float
    dtype: Dtype

    @nn.compact
    def __call__(self, x):
        scale = self.param(
            "scale",
            nn.with_logical_partitioning(nn.initializers.ones, (None,)),
            (x.shape[-1],),
            jnp.float32,
        )
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (y * scale).astype(self.dtype)


def apply_rope(x_BxSxHxD, positions_BxS, theta: float):
    half = x_BxSxHxD.shape[-1] // 2
    inv_freq = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angles_BxSx1xF = (positions_BxS[..., None].astype(jnp.float32) * inv_freq)[:, :, None, :]
    sin, cos = jnp.sin(angles_BxSx1xF), jnp.cos(angles_BxSx1xF)
    x1, x2 = jnp.split(x_BxSxHxD.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x_BxSxHxD.dtype)


class Attention(nn.Module):
    cfg: ModelConfig
    dtype: Dtype
    kernels: KernelsConfig
    interpret: bool
    load_balanced: bool = False

    @nn.compact
    def __call__(self, x_BxSxE, positions_BxS):
        cfg, dt = self.cfg, self.dtype
        e, h, kv, d = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        if cfg.fused_qkv:
            w = weight(self, "qkv", (e, h + 2 * kv, d), ("embed", "heads", None), e)
            qkv = checkpoint_name(dense(x_BxSxE, w.astype(dt)), Tensor.QKV_PROJ)
            q, k, v = jnp.split(qkv, [h, h + kv], axis=2)
        else:
            wq = weight(self, "query", (e, h, d), ("embed", "heads", None), e)
            wk = weight(self, "key", (e, kv, d), ("embed", "kv_heads", None), e)
            wv = weight(self, "value", (e, kv, d), ("embed", "kv_heads", None), e)
            q = dense(x_BxSxE, wq.astype(dt))
            k = dense(x_BxSxE, wk.astype(dt))
            v = dense(x_BxSxE, wv.astype(dt))
        if cfg.qk_norm:  # per head, over head_dim (Qwen3)
            q = RMSNorm(cfg.norm_eps, dt, name="query_norm")(q)
            k = RMSNorm(cfg.norm_eps, dt, name="key_norm")(k)
        # Named as MaxText names them: the attention's inputs, RoPE applied (a saved query
        # is read back by the attention's backward as it is, with nothing to recompute),
        # each device's own sequence chunk (before keys are gathered for context parallelism).
        q = checkpoint_name(apply_rope(q, positions_BxS, cfg.rope_theta), Tensor.QUERY_PROJ)
        k = checkpoint_name(apply_rope(k, positions_BxS, cfg.rope_theta), Tensor.KEY_PROJ)
        v = checkpoint_name(v, Tensor.VALUE_PROJ)
        q = nn.with_logical_constraint(
            q, ("activation_batch", "activation_length", "activation_heads", None)
        )
        # Keys and values as saved: each device's chunk. Unconstrained, the sharding the
        # gather below asks for reaches back to the saved value (no op between them for
        # values): the 70B at 128k kept all 131,072 positions of each layer's values on every
        # device, 224 MiB a layer more than its chunk.
        chunk = ("activation_batch", "activation_length", "activation_kv_heads", None)
        k, v = (nn.with_logical_constraint(x, chunk) for x in (k, v))
        if self.kernels.attention == "splash":
            from trainer.model.splash import sharded_splash_attention  # imports tokamax

            # Gathers keys and values itself; names its output and logsumexp "context"
            # (splash.splash_config).
            ctx = sharded_splash_attention(
                q, k, v, self.kernels, self.interpret, self.load_balanced
            )
        else:
            # Keys and values span the whole sequence: under context parallelism this
            # all-gathers them.
            whole = ("activation_batch", None, "activation_kv_heads", None)
            k, v = (nn.with_logical_constraint(x, whole) for x in (k, v))
            if self.kernels.attention == "cudnn":
                ctx = fused_attention(q, k, v)
            else:
                k_pos = nn.with_logical_constraint(positions_BxS, ("activation_batch", None))
                ctx = reference_attention(
                    q, k, v, positions_BxS, k_pos, self.kernels.max_logit_const
                )
            ctx = checkpoint_name(ctx, Tensor.CONTEXT)
        wo = weight(self, "out", (h, d, e), ("heads", None, "embed"), h * d)
        return checkpoint_name(dense(ctx, wo.astype(dt), contract=2), Tensor.OUT_PROJ)


class Mlp(nn.Module):
    cfg: ModelConfig
    dtype: Dtype
    width: int | None = None  # the hidden width; None: the model's mlp_dim

    @nn.compact
    def __call__(self, x_BxSxE):
        e, f, dt = self.cfg.d_model, self.width or self.cfg.mlp_dim, self.dtype
        wi_0 = weight(self, "wi_0", (e, f), ("embed", "mlp"), e)
        wi_1 = weight(self, "wi_1", (e, f), ("embed", "mlp"), e)
        wo = weight(self, "wo", (f, e), ("mlp", "embed"), f)
        gate = checkpoint_name(dense(x_BxSxE, wi_0.astype(dt)), Tensor.MLPWI_0)
        up = checkpoint_name(dense(x_BxSxE, wi_1.astype(dt)), Tensor.MLPWI_1)
        hidden = nn.with_logical_constraint(
            jax.nn.silu(gate) * up, ("activation_batch", "activation_length", "activation_mlp")
        )
        return checkpoint_name(dense(hidden, wo.astype(dt)), Tensor.MLPWO)


class DecoderLayer(nn.Module):
    cfg: ModelConfig
    dtype: Dtype
    kernels: KernelsConfig
    platform: str
    load_balanced: bool = False
    expert_fp8: PrecisionConfig | None = None  # fp8 experts in tokamax's kernels (fp8_gmm)

    @nn.compact
    def __call__(self, x_BxSxE, positions_BxS):
        cfg = self.cfg
        x = nn.with_logical_constraint(x_BxSxE, ACT_BxSxE)
        x = checkpoint_name(x, Tensor.DECODER_LAYER_INPUT)
        h = RMSNorm(cfg.norm_eps, self.dtype, name="attn_norm")(x)
        attention = Attention(
            cfg,
            self.dtype,
            self.kernels,
            self.platform != "tpu",
            self.load_balanced,
            name="attention",
        )
        x = x + attention(h, positions_BxS)
        h = RMSNorm(cfg.norm_eps, self.dtype, name="mlp_norm")(x)
        if cfg.is_moe:
            moe = MoeBlock(
                cfg, self.dtype, self.kernels, self.platform, self.expert_fp8, name="moe"
            )
            y, aux_loss = moe(h)
            if cfg.shared_width:  # every token's shared experts, one dense MLP (MaxText's)
                y = y + Mlp(cfg, self.dtype, cfg.shared_width, name="shared_mlp")(h)
        else:
            y, aux_loss = Mlp(cfg, self.dtype, name="mlp")(h), jnp.zeros((), jnp.float32)
        x = nn.with_logical_constraint(x + y, ACT_BxSxE)
        return x, aux_loss


class Transformer(nn.Module):
    """Returns (logits_BxSxV in float32, summed MoE load-balancing loss); given targets,
    (mean token cross entropy, that loss) instead, over `vocab_tiling` tiles (trainer/model/loss.py)."""

    cfg: ModelConfig
    remat_policy: Callable[..., Any] | None = None
    dtype: Dtype = jnp.bfloat16
    kernels: KernelsConfig = KernelsConfig()
    platform: str = "cpu"  # Pallas kernels run interpreted unless on tpu
    load_balanced: bool = False  # the sequence arrives in causal load-balanced order (context > 1)
    vocab_tiling: int = 1
    expert_fp8: PrecisionConfig | None = None  # see DecoderLayer

    @nn.compact
    def __call__(self, tokens_BxS, positions_BxS, targets_BxS=None):
        cfg = self.cfg
        embedding = weight(self, "embedding", (cfg.vocab_size, cfg.d_model), ("vocab", "embed"), 1)
        x = jnp.take(embedding.astype(self.dtype), tokens_BxS, axis=0)
        layer = nn.remat(DecoderLayer, policy=self.remat_policy, prevent_cse=False)
        stack = nn.scan(
            layer,
            variable_axes={"params": 0, "quant_stats": 0},  # static fp8 scales per layer
            split_rngs={"params": True},
            in_axes=(nn.broadcast,),
            length=cfg.num_layers,
            metadata_params={nn.PARTITION_NAME: "layers"},
        )
        layers = stack(
            cfg,
            self.dtype,
            self.kernels,
            self.platform,
            self.load_balanced,
            self.expert_fp8,
            name="layers",
        )
        x, aux_per_layer = layers(x, positions_BxS)
        x = RMSNorm(cfg.norm_eps, self.dtype, name="final_norm")(x)
        unembed = weight(
            self, "unembed", (cfg.d_model, cfg.vocab_size), ("embed", "vocab"), cfg.d_model
        )
        # Unembed only once the decoder is done: left free, XLA's scheduler starts the
        # weight's FSDP all-gather before the layer loop, and the whole [d_model, vocab] copy
        # then lives through the forward pass (llama3.1-70b on tpu7x: 1.96 GiB per device at
        # the peak, and the published recipe 0.32 GiB over a device).
        x, unembed = jax.lax.optimization_barrier((x, unembed))
        w = unembed.astype(self.dtype)
        if targets_BxS is None:
            return output_logits(x, w), jnp.sum(aux_per_layer)
        loss = mean_cross_entropy(x, w, targets_BxS, self.vocab_tiling)
        return loss, jnp.sum(aux_per_layer)
