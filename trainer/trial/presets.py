"""Model shapes by name: tiny ones for tests, real ones for compile and estimate trials."""

from __future__ import annotations

from typing import Any

_TINY = dict(vocab_size=256, d_model=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16)

MODEL_PRESETS: dict[str, dict[str, Any]] = {
    "tiny-dense": {**_TINY, "mlp_dim": 128},
    "tiny-moe": {**_TINY, "mlp_dim": 64, "num_experts": 4, "experts_per_token": 2},
    # A CPU-sized model that still spends most of its time in matmuls (benchmarks).
    "small-dense": dict(
        vocab_size=256,
        d_model=256,
        num_layers=4,
        num_heads=8,
        num_kv_heads=4,
        head_dim=32,
        mlp_dim=768,
    ),
    "small-moe": dict(
        vocab_size=256,
        d_model=256,
        num_layers=4,
        num_heads=8,
        num_kv_heads=4,
        head_dim=32,
        mlp_dim=384,
        num_experts=8,
        experts_per_token=2,
    ),
    # Sized for one TPU v5e chip (15.75 GiB): float32 weights, gradients and AdamW moments
    # take 16 bytes a parameter, so these leave 10 GiB for batch. Head width 128 fills v5e's
    # 128-wide MXU; the 32k vocabulary makes the logits a real cost.
    "v5e-dense-270m": dict(
        vocab_size=32768,
        d_model=1024,
        num_layers=12,
        num_heads=8,
        num_kv_heads=8,
        head_dim=128,
        mlp_dim=4096,
    ),
    "v5e-moe-300m": dict(
        vocab_size=32768,
        d_model=1024,
        num_layers=8,
        num_heads=8,
        num_kv_heads=8,
        head_dim=128,
        mlp_dim=1024,
        num_experts=8,
        experts_per_token=2,
    ),
    "llama3-8b": dict(
        vocab_size=128256,
        d_model=4096,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        mlp_dim=14336,
        rope_theta=500000.0,
    ),
    "llama3.1-70b": dict(
        vocab_size=128256,
        d_model=8192,
        num_layers=80,
        num_heads=64,
        num_kv_heads=8,
        head_dim=128,
        mlp_dim=28672,
        rope_theta=500000.0,
    ),
    "llama3.1-405b": dict(
        vocab_size=128256,
        d_model=16384,
        num_layers=126,
        num_heads=128,
        num_kv_heads=8,
        head_dim=128,
        mlp_dim=53248,
        rope_theta=500000.0,
    ),
    "mixtral-8x7b": dict(
        vocab_size=32000,
        d_model=4096,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        mlp_dim=14336,
        num_experts=8,
        experts_per_token=2,
        rope_theta=1000000.0,
    ),
    # Qwen3-235B-A22B (its Hugging Face config): 128 experts, top-8 with the top-k weights
    # renormalized (norm_topk_prob, as this trainer always does), QK-norm, a load-balance loss
    # weight of 0.001 (router_aux_loss_coef; MaxText's model config sets the same).
    "qwen3-235b-a22b": dict(
        vocab_size=151936,
        d_model=4096,
        num_layers=94,
        num_heads=64,
        num_kv_heads=4,
        head_dim=128,
        mlp_dim=1536,
        num_experts=128,
        experts_per_token=8,
        qk_norm=True,
        rope_theta=1000000.0,
        norm_eps=1e-6,
        load_balance_loss_weight=0.001,
    ),
    # DeepSeekMoE-16B's routed experts (64, top-6, 1408 wide); its 2 shared experts and
    # dense first layer are not modelled, hence "class".
    "deepseek-moe-16b-class": dict(
        vocab_size=102400,
        d_model=2048,
        num_layers=28,
        num_heads=16,
        num_kv_heads=16,
        head_dim=128,
        mlp_dim=1408,
        num_experts=64,
        experts_per_token=6,
    ),
}
