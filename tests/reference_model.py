"""An independent reference of the decoder the trainer implements, in NumPy float64.

It shares no code with trainer/: it reads the trainer's parameters by name and recomputes
the forward pass from the textbook definitions (RMSNorm, rotate-half RoPE, causal grouped-
query attention, SwiGLU, untied unembedding), so a change to any of them in trainer/model/transformer.py
shows up as a mismatch.
"""

from __future__ import annotations

from typing import Any

import numpy as np


def rms_norm(x: np.ndarray, scale: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * scale


def rope(x: np.ndarray, positions: np.ndarray, theta: float) -> np.ndarray:
    """Rotate pairs (i, i + D/2) by position * theta^(-i / (D/2)). x: [B, S, H, D]."""
    half = x.shape[-1] // 2
    freq = theta ** (-np.arange(half) / half)
    angle = positions[:, :, None, None] * freq[None, None, None, :]
    a, b = x[..., :half], x[..., half:]
    return np.concatenate([a * np.cos(angle) - b * np.sin(angle),
                           b * np.cos(angle) + a * np.sin(angle)], axis=-1)  # fmt: skip


def causal_gqa(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
    """q: [B, S, H, D]; k, v: [B, S, KV, D]; query head j reads kv head j // (H / KV)."""
    heads, kv_heads, d = q.shape[2], k.shape[2], q.shape[3]
    group = heads // kv_heads
    k = np.repeat(k, group, axis=2)
    v = np.repeat(v, group, axis=2)
    scores = np.einsum("bshd,bthd->bhst", q, k) / np.sqrt(d)
    s = q.shape[1]
    scores = np.where(np.tril(np.ones((s, s), bool)), scores, -np.inf)
    scores -= scores.max(axis=-1, keepdims=True)
    probs = np.exp(scores)
    probs /= probs.sum(axis=-1, keepdims=True)
    return np.einsum("bhst,bthd->bshd", probs, v)


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1 + np.exp(-x))


def forward(params: dict[str, Any], tokens: np.ndarray, *, num_layers: int, eps: float,
            theta: float) -> np.ndarray:  # fmt: skip
    """Logits [B, S, V] of a dense decoder from the trainer's parameter tree (scanned layers)."""
    p = {k: np.asarray(v, np.float64) for k, v in _flat(params).items()}
    positions = np.broadcast_to(np.arange(tokens.shape[1]), tokens.shape).astype(np.float64)
    x = p["embedding"][tokens]
    for i in range(num_layers):
        layer = {k.removeprefix("layers/"): v[i] for k, v in p.items() if k.startswith("layers/")}
        h = rms_norm(x, layer["attn_norm/scale"], eps)
        q = np.einsum("bse,ehd->bshd", h, layer["attention/query"])
        k = np.einsum("bse,ehd->bshd", h, layer["attention/key"])
        v = np.einsum("bse,ehd->bshd", h, layer["attention/value"])
        if "attention/query_norm/scale" in layer:  # QK-norm: per head, before RoPE
            q = rms_norm(q, layer["attention/query_norm/scale"], eps)
            k = rms_norm(k, layer["attention/key_norm/scale"], eps)
        ctx = causal_gqa(rope(q, positions, theta), rope(k, positions, theta), v)
        x = x + np.einsum("bshd,hde->bse", ctx, layer["attention/out"])
        h = rms_norm(x, layer["mlp_norm/scale"], eps)
        gate = h @ layer["mlp/wi_0"]
        x = x + (silu(gate) * (h @ layer["mlp/wi_1"])) @ layer["mlp/wo"]
    return rms_norm(x, p["final_norm/scale"], eps) @ p["unembed"]


def _flat(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}/"))
        else:
            out[f"{prefix}{key}"] = value
    return out
