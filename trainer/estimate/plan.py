"""The guide's decision table as code: primary and secondary strategy, with the figures behind them.

All figures are estimates (trainer.estimate.analytic: datasheet + formulas); they choose where a sweep
starts, they are not results.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from trainer.estimate.analytic import estimate, parameter_count
from trainer.spec.config import load_config
from trainer.spec.hardware import GIB, Topology

LONG_SEQUENCE = 32768  # the guide contrasts 8k (compute-bound) with 128k (memory-bound)
STATE_BYTES_PER_PARAM = 16  # f32 parameters, gradients and two Adam moments


@dataclass
class Recommendation:
    workload: str
    primary: str
    secondary: str
    mesh: dict[str, int]
    remat: str
    reasons: list[str] = field(default_factory=list)
    figures: dict[str, Any] = field(default_factory=dict)


def recommend(model: dict[str, Any], seq_len: int, target: str) -> Recommendation:
    topology = Topology.parse(target)
    accel, devices = topology.accelerator, topology.devices
    fsdp = load_config(
        {"model": model, "seq_len": seq_len, "mesh": {"fsdp": -1}, "remat": {"policy": "full"}}
    )
    cfg = fsdp.model
    params = parameter_count(fsdp)
    state_gib = params * STATE_BYTES_PER_PARAM / GIB
    slice_hbm_gib = devices * accel.usable_hbm_per_device / GIB
    est = estimate(fsdp, accel, devices)
    tp = (
        estimate(
            fsdp.model_copy(update={"mesh": fsdp.mesh.model_copy(update={"tensor": 4})}),
            accel,
            devices,
        )
        if cfg.num_heads % 4 == 0 and cfg.num_kv_heads % 4 == 0
        else None
    )
    figures = {
        "params": params,
        "state_gib": state_gib,
        "slice_usable_hbm_gib": slice_hbm_gib,
        "fsdp_arithmetic_intensity_ici": est["arithmetic_intensity_ici"],
        "hardware_intensity_ici": est["hardware_intensity_ici"],
        "fsdp_bound": est["bound"],
        "fsdp_activation_gib_per_device": est["est_memory_per_device"]["activations"] / GIB,
        "fsdp_est_tokens_per_sec_per_chip": est["est_tokens_per_sec_per_chip"],
    }
    reasons = [
        f"FSDP at per-device batch 1: {est['arithmetic_intensity_ici']:,.0f} FLOP per ICI byte against the "
        f"hardware's {est['hardware_intensity_ici']:,.0f}; bound: {est['bound']} (estimate)"
    ]
    if tp is not None:
        figures["tp4_est_ici_s"], figures["fsdp_est_ici_s"] = tp["est_ici_s"], est["est_ici_s"]
        verdict = (
            "TP adds ICI traffic per FLOP here, as the guide warns"
            if tp["est_ici_s"] > est["est_ici_s"]
            else "here TP shrinks the weights each device gathers, a trade worth one trial despite the guide's rule"
        )
        reasons.append(
            f"tensor parallelism x4 would move ICI time from {est['est_ici_s'] * 1e3:.2f} ms to "
            f"{tp['est_ici_s'] * 1e3:.2f} ms per step (estimate): {verdict}"
        )
    long = seq_len >= LONG_SEQUENCE
    if cfg.is_moe and state_gib > 0.5 * slice_hbm_gib:
        reasons.append(
            f"training state {state_gib:,.0f} GiB exceeds half of the slice's {slice_hbm_gib:,.0f} GiB: split layers across slices"
        )
        return Recommendation(
            "MoE, very large",
            "FSDP + EP + PP",
            "MP (tensor)",
            {"fsdp": -1, "expert": min(cfg.num_experts, 8), "stage": 2},
            "custom (offload decoder_layer_input)",
            reasons,
            figures,
        )
    if cfg.is_moe:
        reasons.append(
            f"{cfg.num_experts} experts: expert parallelism routes tokens by all-to-all instead of gathering every expert"
        )
        return Recommendation(
            "MoE, short sequence" if not long else "MoE, long sequence",
            "FSDP + EP",
            "CP" if long else "-",
            {"fsdp": -1, "expert": _largest_divisor(cfg.num_experts, devices, 8)},
            "minimal" if not long else "full",
            reasons,
            figures,
        )
    if long:
        reasons.append(
            f"sequence {seq_len:,}: activations {figures['fsdp_activation_gib_per_device']:,.1f} GiB per device with full remat; "
            "context parallelism at the smallest degree that fits keeps the batch axis whole"
        )
        return Recommendation(
            "dense, long sequence",
            "FSDP",
            "CP",
            {"fsdp": -1, "context": 2},
            "full",
            reasons,
            figures,
        )
    reasons.append(
        f"sequence {seq_len:,} is compute-bound territory: keep remat light (remat overhead is the main waste)"
    )
    return Recommendation(
        "dense, short sequence", "FSDP", "-", {"fsdp": -1}, "minimal", reasons, figures
    )


def _largest_divisor(n: int, devices: int, cap: int) -> int:
    return max(d for d in range(1, min(n, cap) + 1) if n % d == 0 and devices % d == 0)
