"""The model FLOPs of a training step: one formula for the estimate and the measured MFU."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from trainer.trial.config import ModelConfig


def training_flops_by_kind(model: ModelConfig, global_batch: int, seq_len: int) -> dict[str, float]:
    """MaxText's calculate_tflops_training_per_device, for the whole step (not per device),
    by what runs them: `layer_matmul` (the layers' projections and FFN, what FP8 quantizes),
    `attention` (the causal attention core: Splash, in bf16) and `logits` (the output
    embedding). Forward and backward: 3 x each forward matmul; remat recompute not counted.

    MoE counts the router, the top-k experts and the shared experts.
    """
    tokens = global_batch * seq_len
    ffn_one = 2 * tokens * model.mlp_dim * model.d_model * 3  # wi_0, wi_1, wo
    if model.is_moe:
        ffn = 2 * tokens * model.d_model * model.num_experts + ffn_one * model.experts_per_token
        ffn += 2 * tokens * model.shared_width * model.d_model * 3
    else:
        ffn = ffn_one
    qkv = 2 * tokens * model.d_model * (model.num_heads + 2 * model.num_kv_heads) * model.head_dim
    projection = 2 * tokens * model.d_model * model.num_heads * model.head_dim
    embedding = 2 * tokens * model.d_model * model.vocab_size
    causal_attention = 4 * global_batch * seq_len**2 * model.num_heads * model.head_dim / 2
    return {
        "layer_matmul": float((ffn + qkv + projection) * model.num_layers * 3),
        "attention": float(causal_attention * model.num_layers * 3),
        "logits": float(embedding * 3),
    }


def training_flops_per_step(model: ModelConfig, global_batch: int, seq_len: int) -> float:
    """MaxText's calculate_tflops_training_per_device, for the whole step (not per device):
    the sum of training_flops_by_kind."""
    return float(sum(training_flops_by_kind(model, global_batch, seq_len).values()))
