"""Analytic step model: FLOPs, bytes, communication, memory, roofline time (fidelity: estimate).

Every figure here is an estimate from formulas and a datasheet; none is a measurement.
Compile trials reuse it with the compiler's real memory in place of the estimated one.
"""

from __future__ import annotations

from typing import Any

from trainer.spec.capacity import receive_buffer_groups
from trainer.spec.checks import check_static, global_batch_size
from trainer.spec.config import TrialConfig
from trainer.spec.flops import training_flops_per_step
from trainer.spec.hardware import Accelerator
from trainer.spec.remat import POLICIES

BF16, F32 = 2, 4


# Share of a layer's forward FLOPs recomputed in the backward pass, by what a policy saves.
def parameter_count(config: TrialConfig) -> int:
    m = config.model
    attention = m.d_model * m.head_dim * (2 * m.num_heads + 2 * m.num_kv_heads)
    if m.is_moe:
        mlp = m.num_experts * 3 * m.d_model * m.mlp_dim + m.d_model * m.num_experts
    else:
        mlp = 3 * m.d_model * m.mlp_dim
    return (
        m.num_layers * (attention + mlp + 2 * m.d_model) + 2 * m.vocab_size * m.d_model + m.d_model
    )


def expert_parameter_count(config: TrialConfig) -> int:
    """Parameters of the routed experts (sharded over `expert`, never gathered across it)."""
    m = config.model
    return m.num_layers * m.num_experts * 3 * m.d_model * m.mlp_dim if m.is_moe else 0


def communication_bytes_per_device(
    config: TrialConfig, degrees: dict[str, int], global_batch: int
) -> dict[str, float]:
    """Bytes each device sends per step, by strategy (ring collectives: (n-1)/n of the data)."""
    m = config.model
    params = parameter_count(config)

    def ring(n: int) -> float:
        return (n - 1) / n if n > 1 else 0.0

    shard = degrees["fsdp"] * degrees["context"] * degrees["expert"]
    tokens_local = (
        global_batch
        * config.seq_len
        / (degrees["data"] * degrees["fsdp"] * degrees["expert"] * degrees["context"])
    )
    tensor, expert, context = degrees["tensor"], degrees["expert"], degrees["context"]
    experts = expert_parameter_count(config)
    # What FSDP gathers and scatters per device: dense weights over every sharding axis;
    # a device's own experts (1/expert of them) over fsdp x context only.
    gathered = (params - experts) / tensor * ring(shard) + experts / (tensor * expert) * ring(
        shard // expert
    )
    weights_local = params / tensor
    comm = {
        # weights all-gathered in forward and again in backward; gradients reduce-scattered
        "fsdp_all_gather": 2 * gathered * BF16,
        "fsdp_reduce_scatter": gathered * F32,
        "data_all_reduce": 2 * weights_local / shard * F32 * ring(degrees["data"]),
        # two activation all-reduces per layer forward, two backward
        "tensor_all_reduce": 4 * m.num_layers * tokens_local * m.d_model * BF16 * 2 * ring(tensor),
        "expert_all_to_all": (
            4 * m.num_layers * tokens_local * m.experts_per_token * m.d_model * BF16 * ring(expert)
        )
        if m.is_moe
        else 0.0,
        # keys and values all-gathered forward, their gradients reduce-scattered backward
        "context_kv_all_gather": 2
        * m.num_layers
        * tokens_local
        * 2
        * m.num_kv_heads
        * m.head_dim
        * BF16
        * (context - 1),
    }
    comm["total"] = sum(comm.values())
    return comm


def memory_per_device(
    config: TrialConfig, degrees: dict[str, int], global_batch: int
) -> dict[str, float]:
    """Parameters, optimizer state, gradients and saved activations per device (bytes)."""
    m = config.model
    shards = degrees["fsdp"] * degrees["context"] * degrees["expert"] * degrees["tensor"]
    params = parameter_count(config) / shards
    tokens_local = (
        global_batch
        * config.seq_len
        / (degrees["data"] * degrees["fsdp"] * degrees["expert"] * degrees["context"])
    )
    saved_per_layer = tokens_local * m.d_model * BF16  # the layer input, always saved
    policy = config.remat.policy
    if policy not in ("full",):
        qkv = (
            tokens_local
            * m.head_dim
            * (m.num_heads + 2 * m.num_kv_heads)
            / degrees["tensor"]
            * BF16
        )
        # Expert parallelism receives into a buffer of whole multiples of the device's slots.
        slots = tokens_local * (m.experts_per_token or 1)
        groups = (
            receive_buffer_groups(round(slots), m.num_experts, degrees["expert"], m.capacity_factor)
            if m.is_moe
            else 1
        )
        rows = slots * groups
        mlp = rows * m.mlp_dim * 2 / degrees["tensor"] * BF16
        saved_per_layer += {
            "save_qkv_proj": qkv,
            "save_out_proj": tokens_local * m.d_model * BF16,
        }.get(policy, qkv + mlp)
    # bf16 logits and their gradient (the loss's float32 work stays in its fusions), one
    # tile of them at a time when the loss is tiled.
    logits = tokens_local * m.vocab_size / degrees["tensor"] * BF16 * 2 / config.vocab_tiling
    mu_bytes = BF16 if config.mu_dtype == "bfloat16" else F32
    memory = {
        "params_f32": params * F32,
        "optimizer_state": params * (mu_bytes + F32),
        "gradients_f32": params * F32,
        "activations": m.num_layers * saved_per_layer + logits,
    }
    memory["total"] = sum(memory.values())
    return memory


def estimate(
    config: TrialConfig, accel: Accelerator, num_devices: int, memory_bytes: float | None = None
) -> dict[str, Any]:
    """Roofline step estimate on `num_devices` devices of `accel`; compute, HBM and ICI overlap perfectly."""
    degrees = check_static(config, num_devices)
    global_batch = global_batch_size(config, num_devices)
    chips = num_devices / accel.devices_per_chip
    model_flops = training_flops_per_step(config.model, global_batch, config.seq_len)
    layer_share = (
        1
        - (2 * global_batch * config.seq_len * config.model.d_model * config.model.vocab_size * 3)
        / model_flops
    )
    recompute = model_flops / 3 * layer_share * POLICIES[config.remat.policy].recompute_share
    precision = config.precision.peak
    peak = accel.peak_tflops[precision] * 1e12
    mem = memory_per_device(config, degrees, global_batch)
    comm = communication_bytes_per_device(config, degrees, global_batch)
    flops_per_chip = (model_flops + recompute) / chips
    hbm_bytes_per_chip = accel.devices_per_chip * (
        mem["params_f32"] / F32 * BF16 * 3
        + 2 * (mem["params_f32"] + mem["optimizer_state"] + mem["gradients_f32"])
        + 2 * mem["activations"]
    )
    ici_bytes_per_chip = accel.devices_per_chip * comm["total"]
    times = {
        "compute": flops_per_chip / peak,
        "hbm": hbm_bytes_per_chip / accel.hbm_bytes_per_s,
        "ici": ici_bytes_per_chip / accel.ici_axis_bytes_per_s,  # a ring over one torus axis
    }
    step_time = max(times.values())
    tokens = global_batch * config.seq_len
    used = memory_bytes if memory_bytes is not None else mem["total"]
    return {
        "fidelity": "estimate",
        "hardware": accel.name,
        "chips": chips,
        "model_flops_per_step": model_flops,
        "recompute_flops_per_step": recompute,
        "est_step_time_s": step_time,
        "est_compute_s": times["compute"],
        "est_hbm_s": times["hbm"],
        "est_ici_s": times["ici"],
        "bound": max(times, key=lambda name: times[name]),
        "est_tokens_per_sec_per_chip": tokens / step_time / chips,
        "est_mfu": model_flops / chips / step_time / peak,
        "arithmetic_intensity_ici": flops_per_chip / ici_bytes_per_chip
        if ici_bytes_per_chip
        else float("inf"),
        "hardware_intensity_ici": accel.intensity_flops_per_ici_byte(precision),
        "arithmetic_intensity_hbm": flops_per_chip / hbm_bytes_per_chip,
        "hardware_intensity_hbm": accel.intensity_flops_per_hbm_byte(precision),
        "communication_bytes_per_device": comm,
        "est_memory_per_device": mem,
        "fits": used <= accel.usable_hbm_per_device,
        "usable_hbm_per_device": accel.usable_hbm_per_device,
    }
