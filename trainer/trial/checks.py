"""Checks of a trial configuration that need no JAX, only the device count (and, where
known, the platform): mesh, batch, sequence, kernel tiles, fp8 experts. They run before
anything compiles: in the engine for every sampled point, and in the trainer."""

from __future__ import annotations

import math

from trainer.trial.config import (
    BATCH_AXES,
    Q_BLOCKS,
    ConfigError,
    KernelsConfig,
    PrecisionConfig,
    TrialConfig,
)
from trainer.trial.hardware import Backend


def global_batch_size(config: TrialConfig, num_devices: int) -> int:
    global_batch = config.per_device_batch * num_devices
    if abs(global_batch - round(global_batch)) > 1e-9:
        raise ConfigError(
            "per_device_batch",
            f"{config.per_device_batch} x {num_devices} devices = {global_batch} is not a whole batch",
        )
    return round(global_batch)


def check_batch_and_sequence(
    config: TrialConfig, degrees: dict[str, int], num_devices: int
) -> None:
    """Static divisibility checks that need only the resolved mesh degrees."""
    global_batch = global_batch_size(config, num_devices)
    batch_shards = math.prod(degrees[a] for a in BATCH_AXES)
    if global_batch % batch_shards:
        raise ConfigError(
            "per_device_batch",
            f"global batch {global_batch} is not divisible by data x fsdp x expert = {batch_shards}; "
            "raise per_device_batch or move degree to context/tensor",
        )
    experts = config.model.num_experts
    if config.model.is_moe and experts % degrees["expert"]:
        raise ConfigError(
            "mesh",
            f"num_experts {experts} is not divisible by mesh.expert = {degrees['expert']}: "
            "each expert shard holds whole experts; use an expert degree dividing num_experts",
        )
    chunks = degrees["context"] * (
        2 if config.mesh.context_load_balance and degrees["context"] > 1 else 1
    )
    if config.seq_len % chunks:
        what = "2 x context (load balancing)" if chunks != degrees["context"] else "context"
        raise ConfigError("seq_len", f"{config.seq_len} is not divisible by {what} = {chunks}")
    if config.seq_len % config.vocab_tiling:
        raise ConfigError(
            "vocab_tiling",
            f"{config.vocab_tiling} does not divide seq_len {config.seq_len}: the loss is tiled "
            "along the sequence; use a divisor of seq_len",
        )


def check_kernels(
    config: TrialConfig, degrees: dict[str, int], num_devices: int, platform: Backend | None
) -> None:
    """Kernel tiles the kernels would reject, and kernels the backend cannot run, caught
    before anything compiles. With no platform, `auto` is left to the run that resolves it."""
    kernels = config.kernels
    if platform is not None:
        kernels = config.resolved_kernels(platform, degrees["context"])
    if kernels.attention == "cudnn":
        if platform is not None and platform != Backend.GPU:
            raise ConfigError(
                "kernels.attention",
                f"cudnn is NVIDIA's fused attention and does not run on {platform}; use auto or xla",
            )
        if degrees["context"] > 1:
            raise ConfigError(
                "kernels.attention",
                "cudnn attends over whole causal sequences, not context shards; with "
                "mesh.context > 1 use auto (which keeps xla there) or xla",
            )
    if kernels.attention == "splash":
        _check_splash_blocks(config, kernels, degrees["context"])
    if config.model.is_moe and config.fp8_experts:
        check_fp8_experts(config.precision, kernels.moe_gmm, platform)
    int8_experts = config.precision.mode == "int8" and config.precision.targets == "dense+moe"
    if config.model.is_moe and int8_experts and kernels.moe_gmm != "ragged_dot":
        raise ConfigError(
            "precision.targets",
            f"int8 experts are quantized through ragged_dot only (qwix intercepts "
            f"lax.ragged_dot); {kernels.moe_gmm}'s kernel would multiply them in bf16: set "
            "precision.targets dense, or kernels.moe_gmm ragged_dot",
        )
    if config.model.is_moe and kernels.moe_gmm == "megablox":
        # On TPU each device runs the kernel on its own tokens (shard_map), so the tile must
        # divide the per-device routed rows (which also divide the global count used off TPU).
        shards = math.prod(degrees[a] for a in BATCH_AXES) * degrees["context"]
        rows = (
            global_batch_size(config, num_devices)
            * config.seq_len
            * config.model.experts_per_token
            // shards
        )
        if rows % kernels.gmm_tm:
            raise ConfigError(
                "kernels.gmm_tm",
                f"{kernels.gmm_tm} must divide the routed token count per device "
                f"(batch x seq x experts_per_token / batch and context shards = {rows})",
            )


def _check_splash_blocks(config: TrialConfig, kernels: KernelsConfig, context: int) -> None:
    """Splash's blocks (clamped to the sequence): multiples of 128 dividing the sequence, each
    compute block dividing its block, query blocks dividing the per-device query length."""
    local = config.seq_len // context
    clamped = kernels.blocks(local, config.seq_len)
    for name, block in clamped.items():
        if block % 128:
            was = (
                ""
                if block == getattr(kernels, name)
                else f" (clamped from {getattr(kernels, name)} to its sequence)"
            )
            raise ConfigError(f"kernels.{name}", f"{block}{was} must be a multiple of 128")
        if config.seq_len % block:
            raise ConfigError(f"kernels.{name}", f"{block} must divide seq_len ({config.seq_len})")
    for compute, whole in (
        ("block_kv_compute", "block_kv"),
        ("block_kv_dkv_compute", "block_kv_dkv"),
    ):
        if clamped[whole] % clamped[compute]:
            raise ConfigError(
                f"kernels.{compute}",
                f"{clamped[compute]} must divide {whole} ({clamped[whole]})",
            )
    for name in Q_BLOCKS:  # queries are split over the context axis
        if local % clamped[name]:
            raise ConfigError(
                f"kernels.{name}",
                f"{clamped[name]} must divide the per-device query length "
                f"(seq_len / context = {local})",
            )


def check_fp8_experts(precision: PrecisionConfig, moe_gmm: str, platform: Backend | None) -> None:
    """fp8 experts run through qwix's ragged_dot, or in tokamax's TPU kernels
    (trainer/model/fp8_gmm.py), which take dynamic or fixed scales per tensor or per axis."""
    if moe_gmm == "megablox":
        raise ConfigError(
            "kernels.moe_gmm",
            "fp8 of the MoE grouped matmul runs through ragged_dot or tokamax; with megablox the "
            "experts would silently stay bf16. Use moe_gmm ragged_dot or tokamax, or "
            "precision.targets dense",
        )
    if moe_gmm != "tokamax":
        return
    if platform == Backend.GPU:
        raise ConfigError(
            "kernels.moe_gmm",
            "tokamax's GPU grouped matmuls take fp8 weights only with subchannel scales and "
            "multiply the rows in bf16: fp8 experts on GPU run through ragged_dot (moe_gmm auto "
            "or ragged_dot), or use precision.targets dense to run the experts on tokamax in bf16",
        )
    if precision.scaling == "static":
        raise ConfigError(
            "precision.scaling",
            "fp8 experts in tokamax's kernels take dynamic or fixed scales; static ones are "
            "kept by qwix for the dense layers only (use dynamic or fixed, or precision.targets "
            "dense)",
        )
    if precision.granularity == "subchannel":
        raise ConfigError(
            "precision.granularity",
            "fp8 experts in tokamax's kernels are scaled per tensor or per axis, not per "
            "subchannel tile (use per_tensor or per_axis, or precision.targets dense)",
        )


def check_precision(config: TrialConfig) -> None:
    """A subchannel tile must divide the innermost contraction axis of every quantized matmul."""
    precision, model = config.precision, config.model
    if precision.mode != "fp8" or precision.tile_size is None:  # the tile comes with subchannel
        return
    axes = {"d_model": model.d_model, "head_dim": model.head_dim, "mlp_dim": model.mlp_dim}
    bad = {name: size for name, size in axes.items() if size % precision.tile_size}
    if bad:
        raise ConfigError(
            "precision.tile_size",
            f"{precision.tile_size} must divide the contraction axes of the quantized matmuls; it does not divide {bad}",
        )


def check_profile(config: TrialConfig) -> None:
    profile = config.profile
    if profile is not None and profile.start_step + profile.steps > config.steps:
        raise ConfigError(
            "profile.start_step",
            f"steps {profile.start_step}..{profile.start_step + profile.steps - 1} are traced, "
            f"but the trial trains {config.steps}; trace earlier steps or train longer",
        )


def check_static(
    config: TrialConfig, num_devices: int, platform: Backend | None = None
) -> dict[str, int]:
    """Every check that needs no JAX: mesh, batch, sequence and kernel tiles (those `auto`
    resolves to on `platform`, when it is known)."""
    degrees = config.mesh.resolve(num_devices)
    check_batch_and_sequence(config, degrees, num_devices)
    check_kernels(config, degrees, num_devices, platform)
    check_precision(config)
    check_profile(config)
    return degrees
