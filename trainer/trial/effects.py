"""Which knobs really act on the backend a trial runs on; inert ones are reported, not hidden."""

from __future__ import annotations

from trainer.trial.config import KernelsConfig, TrialConfig
from trainer.trial.events import EffectStatus, KnobEffect
from trainer.trial.hardware import Backend
from trainer.trial.remat import uses_offload

# What each backend does natively (JAX-free: the trainer's report and the engine's pinning
# of inert values both read these).
NATIVE_RAGGED_A2A = ("tpu", "gpu")  # XLA ragged all-to-all; elsewhere an all-gather
NO_HOST_OFFLOAD = ("cpu",)  # host placement dropped: offload compiles to remat
FP8_EMULATED = ("cpu",)  # XLA upcasts fp8 dots to f32
PALLAS_NATIVE = ("tpu",)  # Pallas TPU kernels run compiled; elsewhere interpreted
LIBTPU = ("tpu",)  # LIBTPU_INIT_ARGS reach only libtpu
TOKAMAX_GMM_KERNEL = ("gpu", "tpu")  # tokamax.ragged_dot has a kernel; elsewhere XLA's
CUDNN = ("gpu",)  # cuDNN fused attention
GPU_RAGGED_DOT = (
    "XLA:GPU expands ragged_dot into a dense dot over every expert (the experts' FLOPs times "
    "their number)"
)


def _effect(status: EffectStatus, reason: str) -> KnobEffect:
    return KnobEffect(status=status, reason=reason)


def knob_effects(
    config: TrialConfig,
    platform: Backend,
    degrees: dict[str, int] | None = None,
    gpu_gmm: tuple[str | None, dict[str, str]] | None = None,
) -> dict[str, KnobEffect]:
    """Each knob's status on `platform`: active, inert, emulated or interpreted, and why.
    `gpu_gmm` is what `kernels.tokamax_gpu_gmm` found for a GPU trial's device: tokamax's
    grouped-matmul kernel that builds there, and why the others did not."""
    expert = degrees["expert"] if degrees else config.mesh.expert
    context = degrees["context"] if degrees else config.mesh.context
    kernels = config.resolved_kernels(platform, context)
    return {
        **_parallelism(config, platform, expert),
        **_flags(config, platform),
        **_precision(config, platform),
        **_attention(config, platform, kernels),
        **_experts(config, platform, kernels, gpu_gmm),
    }


def _active(reason: str) -> KnobEffect:
    return _effect(EffectStatus.ACTIVE, reason)


def _parallelism(config: TrialConfig, platform: Backend, expert: int) -> dict[str, KnobEffect]:
    effects = {
        "mesh": _active(f"sharded over {platform} devices"),
        "remat.policy": _active("changes saved tensors, memory and recompute"),
    }
    if config.model.is_moe and expert != 1:
        effects["mesh.expert"] = (
            _active("tokens travel to their experts' devices by ragged all-to-all")
            if platform in NATIVE_RAGGED_A2A
            else _effect(
                EffectStatus.EMULATED,
                f"XLA on {platform} has no ragged all-to-all: the same exchange runs as an "
                "all-gather (exact numerics, not TPU traffic or speed)",
            )
        )
    if uses_offload(config.remat):
        effects["remat.offload"] = (
            _effect(
                EffectStatus.INERT,
                "the CPU backend drops host placement: offload behaves as remat",
            )
            if platform in NO_HOST_OFFLOAD
            else _active("offloaded to pinned host memory")
        )
    return effects


def _flags(config: TrialConfig, platform: Backend) -> dict[str, KnobEffect]:
    if config.xla.is_default:
        return {}
    if platform in LIBTPU:
        return {"xla": _active("LIBTPU_INIT_ARGS: " + " ".join(config.xla.libtpu_init_args()))}
    return {"xla": _effect(EffectStatus.INERT, f"LIBTPU flags do not reach the {platform} backend")}


def _precision(config: TrialConfig, platform: Backend) -> dict[str, KnobEffect]:
    effects: dict[str, KnobEffect] = {}
    if config.precision.mode == "fp8":
        effects["precision"] = (
            _effect(
                EffectStatus.EMULATED,
                "XLA on CPU upcasts fp8 to f32: numerics are real, speed is not a TPU finding",
            )
            if platform in FP8_EMULATED
            else _active("fp8 dot operands via qwix")
        )
    if config.precision.mode == "int8":
        effects["precision"] = (
            _active("int8 dot operands via qwix (the MXU's integer mode)")
            if platform == Backend.TPU
            else _effect(
                EffectStatus.EMULATED,
                f"int8 dot operands via qwix: numerics are real; {platform} speed of int8 "
                "dots is not a TPU finding",
            )
        )
    if config.model.is_moe and config.fp8_experts and not config.fp8_experts_in_tokamax(platform):
        precision = config.precision
        unlike = [
            f"{knob} {value}"
            for knob, value, experts in (
                ("granularity", precision.granularity, "per_axis"),
                ("scaling", precision.scaling, "dynamic"),
            )
            if value != experts
        ]
        if unlike:
            effects["precision.experts"] = _active(
                "the experts are quantized by qwix's ragged_dot, which takes dynamic "
                f"scales per row and per column: {' and '.join(unlike)} "
                f"{'reaches' if len(unlike) == 1 else 'reach'} the dense layers only (with "
                "moe_gmm tokamax on TPU, the experts too)"
            )
    return effects


def _attention(
    config: TrialConfig, platform: Backend, kernels: KernelsConfig
) -> dict[str, KnobEffect]:
    effects: dict[str, KnobEffect] = {}
    if config.kernels.attention == "auto":
        effects["kernels.attention"] = _active(
            f"auto resolved to {kernels.attention} on {platform}"
        )
    if kernels.attention == "splash":
        effects["kernels.splash_blocks"] = _kernel_effect(
            platform, "Splash attention", "tiles and layouts"
        )
    if config.kernels.max_logit_const is not None:
        effects["kernels.max_logit_const"] = _active("numerics: softmax uses exp(s - c)")
    if config.kernels.dq_reduction_steps:
        effects["kernels.dq_reduction_steps"] = _dq_reduction_effect(config, platform, kernels)
    tune = tune_effect(config, platform)
    if tune is not None:
        effects["kernels.tune"] = tune
    return effects


def tune_effect(config: TrialConfig, platform: Backend, maxtext: bool = False) -> KnobEffect | None:
    """Where `kernels.tune` cannot act, why (where it can, the tuner's record says what it did).
    `maxtext`: a MaxText trial's (it takes only its Splash blocks; `time` is refused there)."""
    tune = config.kernels.tune
    if tune == "compile" and config.compile_target is None:
        run = (
            f"a MaxText run on {platform} takes its Splash blocks as set"
            if maxtext
            else f"a run on {platform} takes the tiles as set (`time` times them on a TPU)"
        )
        return _effect(
            EffectStatus.INERT,
            f"the compile tuner compiles for a TPU target (compile fidelity); {run}",
        )
    if tune == "time" and config.compile_target is not None:
        return _effect(
            EffectStatus.INERT,
            "no device to time kernels on at compile fidelity (`compile` prices them there)",
        )
    if tune == "time" and platform != Backend.TPU:
        return _effect(
            EffectStatus.INERT,
            f"timing needs the TPU: a {platform} interprets Pallas TPU kernels or runs none of "
            "them, so their time there says nothing of a TPU's; the tiles run as set",
        )
    return None


def _dq_reduction_effect(
    config: TrialConfig, platform: Backend, kernels: KernelsConfig
) -> KnobEffect:
    """The fused backward sums dQ over its key/value blocks in 3 buffers: only Splash has
    them. With 3 buffers tokamax also runs a dynamic grid, so the program changes even where
    there are 3 blocks or fewer (2 blocks: 3 dQ buffers instead of 2, more memory)."""
    if kernels.attention != "splash":
        return _effect(
            EffectStatus.INERT,
            f"{kernels.attention} attention has no Splash backward",
        )
    if platform not in PALLAS_NATIVE:
        return _kernel_effect(platform, "Splash attention")
    steps = config.seq_len // kernels.blocks(config.seq_len, config.seq_len)["block_kv_dkv"]
    return _active(
        f"the fused backward sums dQ in 3 buffers in the kernel, not {steps} partials after it"
    )


def _experts(
    config: TrialConfig,
    platform: Backend,
    kernels: KernelsConfig,
    gpu_gmm: tuple[str | None, dict[str, str]] | None,
) -> dict[str, KnobEffect]:
    effects: dict[str, KnobEffect] = {}
    if config.model.is_moe:
        if config.kernels.moe_gmm == "auto":
            effects["kernels.moe_gmm"] = _active(
                f"auto resolved to {kernels.moe_gmm} on {platform}"
            )
        if kernels.moe_gmm == "megablox":
            effects["kernels.gmm_tiles"] = _kernel_effect(platform, "Megablox GMM")
        if config.fp8_experts_in_tokamax(platform):
            effects["kernels.moe_gmm"] = _fp8_experts_effect(platform)
        elif kernels.moe_gmm == "tokamax" and platform not in TOKAMAX_GMM_KERNEL:
            effects["kernels.moe_gmm"] = _effect(
                EffectStatus.INERT,
                f"tokamax has no grouped-matmul kernel for {platform}: it runs XLA's "
                "ragged_dot, the same program as moe_gmm ragged_dot",
            )
        if kernels.moe_gmm == "tokamax" and platform == Backend.GPU and gpu_gmm is not None:
            effects["kernels.moe_gmm"] = _tokamax_gpu_effect(config.kernels.moe_gmm, *gpu_gmm)
        if kernels.moe_gmm == "ragged_dot" and platform == Backend.GPU:
            said = (
                "auto resolved to ragged_dot on gpu: " if config.kernels.moe_gmm == "auto" else ""
            )
            why = (
                "fp8 experts on GPU are quantized through ragged_dot only (precision.targets "
                "dense runs them on tokamax's kernel in bf16); "
                if config.fp8_experts
                else ""
            )
            effects["kernels.moe_gmm"] = _active(f"{said}{why}{GPU_RAGGED_DOT}")
    if not config.kernels.tokamax_tiles.is_default:
        runs = config.model.is_moe and kernels.moe_gmm == "tokamax" and platform == Backend.TPU
        effects["kernels.tokamax_tiles"] = (
            _active("tiles of tokamax's TPU grouped-matmul kernels")
            if runs
            else _effect(
                EffectStatus.INERT,
                "they tile tokamax's TPU grouped-matmul kernels, which this trial "
                f"does not run (moe_gmm {kernels.moe_gmm} on {platform})",
            )
        )
    return effects


def _fp8_experts_effect(platform: Backend) -> KnobEffect:
    if platform == Backend.TPU:
        return _effect(
            EffectStatus.ACTIVE,
            "fp8 experts in tokamax's Mosaic TPU kernels: fp8 operands in the forward "
            "and both gradients (trainer/model/fp8_gmm.py)",
        )
    return _effect(
        EffectStatus.EMULATED,
        "fp8 experts quantized as tokamax's TPU kernels take them (trainer/model/fp8_gmm.py); "
        f"on {platform} tokamax's XLA path multiplies them dequantized: numerics, not speed",
    )


def _tokamax_gpu_effect(asked: str, kernel: str | None, failures: dict[str, str]) -> KnobEffect:
    said = "auto resolved to tokamax on gpu: " if asked == "auto" else ""
    if kernel:
        return _effect(EffectStatus.ACTIVE, f"{said}tokamax's {kernel} grouped matmul")
    why = "; ".join(f"{name}: {error}" for name, error in failures.items())
    return _effect(
        EffectStatus.INERT,
        f"{said}no tokamax grouped-matmul kernel builds with this JAX ({why}): it runs "
        f"XLA's ragged_dot: {GPU_RAGGED_DOT}",
    )


def _kernel_effect(platform: Backend, name: str, knobs: str = "tiles") -> KnobEffect:
    if platform in PALLAS_NATIVE:
        return _effect(EffectStatus.ACTIVE, f"{name} Pallas kernel with these {knobs}")
    return _effect(
        EffectStatus.INTERPRETED,
        f"{name} runs with interpret=True on {platform}: correctness only, tiles have no speed meaning",
    )
