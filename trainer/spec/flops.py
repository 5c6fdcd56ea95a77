"""The model FLOPs of a training step: one formula for the estimate and the measured MFU."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from trainer.spec.config import ModelConfig


def training_flops_per_step(model: ModelConfig, global_batch: int, seq_len: int) -> float:
    """MaxText's calculate_tflops_training_per_device, for the whole step (not per device).

    3 x (FFN + QKV + output projection) per layer + embedding, plus 3 x causal attention;
    MoE counts the router and the top-k experts. Remat recompute is not counted.
    """
    tokens = global_batch * seq_len
    ffn_one = 2 * tokens * model.mlp_dim * model.d_model * 3  # wi_0, wi_1, wo
    if model.is_moe:
        ffn = 2 * tokens * model.d_model * model.num_experts + ffn_one * model.experts_per_token
    else:
        ffn = ffn_one
    qkv = 2 * tokens * model.d_model * (model.num_heads + 2 * model.num_kv_heads) * model.head_dim
    projection = 2 * tokens * model.d_model * model.num_heads * model.head_dim
    embedding = 2 * tokens * model.d_model * model.vocab_size
    causal_attention = 4 * global_batch * seq_len**2 * model.num_heads * model.head_dim / 2
    learnable = ((ffn + qkv + projection) * model.num_layers + embedding) * 3
    attention = causal_attention * model.num_layers * 3
    return float(learnable + attention)
