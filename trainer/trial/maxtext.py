"""A trial's knobs in MaxText's terms, and back: the one mapping (export, the MaxText trial
program, and the tests that parse each setting back all read this table). JAX-free.

A trial becomes MaxText settings (`key=value` overrides of MaxText's base.yml) and
LIBTPU_INIT_ARGS. A field MaxText has no setting for (or none that means the same) is
listed in `MaxTextSettings.unmapped` with the reason: never dropped in silence.
Keys and values as MaxText 0.2.5 reads them (its pydantic config refuses unknown keys).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import Field, field_validator

from trainer.trial.config import SPLASH_BLOCKS, ConfigError, PrecisionConfig, TrialConfig
from trainer.trial.flags import ASYNC_FUSION, RAGGED_DOT_KERNEL, SPARSECORE_OFFLOAD
from trainer.trial.hardware import Backend, Topology, standard_slice
from trainer.trial.maxtext_sharding import FOLDED, MAXTEXT_AXES, MESH_AXES
from trainer.trial.presets import MODEL_PRESETS
from trainer.trial.remat import EXPERT_TENSORS, Tensor
from trainer.trial.schema import Frozen

# The settings MaxText 0.2.5 accepts: the top-level keys of its configs/base.yml (its pydantic
# config refuses any other). The file says how to regenerate it.
BASE_KEYS = frozenset(
    line.strip()
    for line in Path(__file__).with_name("maxtext_0.2.5_base_keys.txt").read_text().splitlines()
    if line.strip() and not line.startswith("#")
)
# MaxText 0.2.5's entry points (the pip package's modules).
TRAIN = "maxtext.trainers.pre_train.train"
TRAIN_COMPILE = "maxtext.trainers.pre_train.train_compile"
# A knob `maxtext.<key>` sets MaxText's `<key>` in a MaxText trial.
KNOB_PREFIX = "maxtext."
PYTHON_ENV = "SWEEPER_MAXTEXT_PYTHON"
# Where `make maxtext` builds MaxText's environment (its own Python 3.12).
MAXTEXT_VENV = Path(__file__).resolve().parents[2] / ".maxtext"
Scalar = str | int | float | bool


class MaxTextRecipe(Frozen):
    """The MaxText command a space was imported from (`sweeper import`). Trial 0 runs it as it
    was; any trial runs it with what its configuration changes against `trial`."""

    command: str = ""
    """the command as it was given (provenance; not read)."""
    settings: dict[str, str]
    """its key=value settings as MaxText 0.2.5 names them, values as written."""
    libtpu_init_args: list[str] = Field(default_factory=list)
    """its LIBTPU_INIT_ARGS (XLA_FLAGS' compiler flags included)."""
    trial: dict[str, Any]
    """the trial configuration these settings are, as the importer read them: a trial's
    settings are the recipe's, changed where its configuration maps differently."""
    changes: list[str] = Field(default_factory=list)
    """what the importer changed for MaxText 0.2.5 or the engine (a renamed key, a setting
    dropped, the run's name and output folder), or kept though MaxText reads nothing of it,
    each with why."""
    unmodeled: list[str] = Field(default_factory=list)
    """the model's features the engine's estimates do not model (its checks and MFU use the
    shape alone)."""

    @field_validator("settings")
    @classmethod
    def _known(cls, settings: dict[str, str]) -> dict[str, str]:
        unknown = sorted(set(settings) - BASE_KEYS)
        if unknown:
            raise ValueError(f"{unknown[0]!r} is not a MaxText 0.2.5 setting (its base.yml keys)")
        return settings

    def config(self) -> TrialConfig:
        return TrialConfig.model_validate(self.trial)


class MaxTextProgram(Frozen):
    """A space's `maxtext:` section: which MaxText runs its trials, and settings every trial
    of it gets beside those its knobs map to."""

    python: str = ""
    """MaxText's Python (default: $SWEEPER_MAXTEXT_PYTHON, else the one `make maxtext` built)."""
    model_name: str | None = None
    """MaxText's model_name, where the space's model has none of its own."""
    base_config: str | None = None
    """MaxText's base config file (default: the package's configs/base.yml)."""
    extra: dict[str, Scalar] = Field(default_factory=dict)
    """more MaxText settings (keys of its base.yml), e.g. {dcn_data_parallelism: 2}."""
    recipe: MaxTextRecipe | None = None
    """the command the space was imported from (`sweeper import`): each trial runs it, changed
    where the trial's configuration differs from the recipe's."""

    @field_validator("extra")
    @classmethod
    def _known(cls, extra: dict[str, Scalar]) -> dict[str, Scalar]:
        unknown = sorted(set(extra) - BASE_KEYS)
        if unknown:
            raise ValueError(f"{unknown[0]!r} is not a MaxText 0.2.5 setting (its base.yml keys)")
        return extra

    def interpreter(self) -> str:
        """The Python that runs MaxText, as a path."""
        chosen = self.python or os.environ.get(PYTHON_ENV) or str(MAXTEXT_VENV / "bin" / "python")
        return os.path.expanduser(chosen)


def check_knob_key(path: str) -> str | None:
    """Why a knob path `maxtext.<key>` is not a MaxText setting; None when it is."""
    key = path.removeprefix(KNOB_PREFIX)
    if key not in BASE_KEYS:
        return f"{key!r} is not a MaxText 0.2.5 setting (its configs/base.yml keys)"
    return None


# Our presets that are MaxText models of the same shape (its `model_name`).
MODEL_NAMES = {
    "llama3-8b": "llama3-8b",
    "llama3.1-70b": "llama3.1-70b",
    "llama3.1-405b": "llama3.1-405b",
    "mixtral-8x7b": "mixtral-8x7b",
    "qwen3-235b-a22b": "qwen3-235b-a22b",
}
# 1:1 settings: trial field -> MaxText key (the value as it is).
RENAMED = {
    "seq_len": "max_target_length",
    "per_device_batch": "per_device_batch_size",
    "steps": "steps",
    "learning_rate": "learning_rate",
    "weight_decay": "adam_weight_decay",
    "grad_clip": "gradient_clipping_threshold",
    "mu_dtype": "mu_dtype",
    "vocab_tiling": "num_vocab_tiling",
    "seed": "data_shuffle_seed",
    "mesh.data": "ici_data_parallelism",
    "mesh.fsdp": "ici_fsdp_parallelism",
    "mesh.context": "ici_context_parallelism",
    "mesh.expert": "ici_expert_parallelism",
    "mesh.tensor": "ici_tensor_parallelism",
    "mesh.context_load_balance": "context_parallel_load_balance",
    "remat.policy": "remat_policy",
    "model.capacity_factor": "capacity_factor",
    "model.load_balance_loss_weight": "load_balance_loss_weight",
    **{f"kernels.{block}": f"sa_{block}" for block in SPLASH_BLOCKS},
    "kernels.dq_reduction_steps": "dq_reduction_steps",
}
# The model's shape, for a model MaxText has no name for (with override_model_config).
SHAPE = {
    "model.vocab_size": "vocab_size",
    "model.d_model": "base_emb_dim",
    "model.num_layers": "base_num_decoder_layers",
    "model.num_heads": "base_num_query_heads",
    "model.num_kv_heads": "base_num_kv_heads",
    "model.head_dim": "head_dim",
    "model.mlp_dim": "base_mlp_dim",
    "model.num_experts": "num_experts",
    "model.experts_per_token": "num_experts_per_tok",
    "model.fused_qkv": "fused_qkv",
    "model.rope_theta": "rope_max_timescale",
    "model.norm_eps": "normalization_layer_epsilon",
}
LAYOUTS = {"q_layout": "sa_q_layout", "k_layout": "sa_k_layout", "v_layout": "sa_v_layout"}
ATTENTION = {"splash": "flash", "xla": "dot_product", "cudnn": "cudnn_flash_te"}
# MaxText names a custom policy's tensors as we do, the MoE twins aside.
CUSTOM_TENSORS = tuple(t.value for t in Tensor)
# The grouped-matmul tiles MaxText reads, per weight and pass, in the kernel's order (rows,
# contraction, output columns; `kernels.TokamaxTiles`).
GMM_TILE_KEYS = {
    "wi_fwd": ("wi_tile_fwd_batch_seq", "wi_tile_fwd_embed_dim", "wi_tile_fwd_mlp_dim"),
    "wi_dlhs": ("wi_tile_dlhs_batch_seq", "wi_tile_dlhs_mlp_dim", "wi_tile_dlhs_embed_dim"),
    "wi_drhs": ("wi_tile_drhs_batch_seq", "wi_tile_drhs_embed_dim", "wi_tile_drhs_mlp_dim"),
    "wo_fwd": ("wo_tile_fwd_batch_seq", "wo_tile_fwd_mlp_dim", "wo_tile_fwd_embed_dim"),
    "wo_dlhs": ("wo_tile_dlhs_batch_seq", "wo_tile_dlhs_embed_dim", "wo_tile_dlhs_mlp_dim"),
    "wo_drhs": ("wo_tile_drhs_batch_seq", "wo_tile_drhs_mlp_dim", "wo_tile_drhs_embed_dim"),
}
# Settings that make MaxText's program the trainer's where both have a default: bf16
# activations, AdamW with the trainer's betas, the fused Splash backward, no checkpoints.
FIXED = {
    "dtype": "bfloat16",
    "opt_type": "adamw",
    "adam_b1": "0.9",
    "adam_b2": "0.95",
    "lr_schedule_type": "cosine",
    "learning_rate_final_fraction": "0.1",
    "sa_use_fused_bwd_kernel": "true",
    "enable_checkpointing": "false",
}
# Training settings of a trial that MaxText has nothing to set for. (The engine's own
# settings, convergence, limits, fault and xla.judge, are no part of a MaxText run.)
TRAINER_ONLY = {
    "num_devices": "MaxText trains on every device of the slice",
    "cpu_cores": "MaxText runs on the host's cores",
    "measure.skip_steps": "MaxText reports every step's time; the engine skips warm-up steps",
    "data.max_corpus_mib": "the stdlib corpus is this trainer's",
}


@dataclass(frozen=True)
class Unmapped:
    """A setting of the trial that MaxText cannot take as it is, and why."""

    field: str
    value: Any
    why: str


@dataclass
class MaxTextSettings:
    """What a MaxText run of the trial is given."""

    args: dict[str, str]  # base.yml overrides
    libtpu_init_args: list[str]
    unmapped: list[Unmapped] = field(default_factory=list)

    def argv(self) -> list[str]:
        return [f"{key}={value}" for key, value in self.args.items()]


def grad_bytes(program: MaxTextProgram, knobs: dict[str, Any]) -> int:
    """Bytes a MaxText trial keeps each gradient in: its `grad_dtype` (the point's
    `maxtext.grad_dtype`, else the space's `maxtext.extra`, else the imported recipe's, else
    MaxText's float32). MaxText casts the float32 gradients to it after the backward, and its
    compiled program then accumulates them so: deepseek3-671b's recipe (grad_dtype bfloat16)
    holds bfloat16 accumulators at its peak (docs/facts.md). Our trainer keeps float32."""
    recipe = program.recipe.settings if program.recipe is not None else {}
    dtype = knobs.get(f"{KNOB_PREFIX}grad_dtype", program.extra.get("grad_dtype"))
    dtype = str(dtype if dtype is not None else recipe.get("grad_dtype", "float32"))
    return 2 if dtype in ("bfloat16", "float16") else 4


def program_settings(
    config: TrialConfig,
    program: MaxTextProgram,
    knobs: dict[str, Any] | None = None,
    platform: Backend = Backend.TPU,
) -> MaxTextSettings:
    """The settings of a MaxText trial: the trial's knobs mapped (`to_maxtext`; over an imported
    recipe, the recipe's settings changed where the trial maps differently from it), then the
    space's `maxtext:` section, then the point's `maxtext.*` knobs (each named as MaxText's)."""
    settings = to_maxtext(config, platform)
    if program.recipe is not None:
        settings = over_recipe(program.recipe, settings, platform)
    if program.model_name:
        settings.args["model_name"] = program.model_name
    for key, value in {**program.extra, **(knobs or {})}.items():
        settings.args[key.removeprefix(KNOB_PREFIX)] = _text(value)
    return settings


TOKAMAX_TILES_UNMAPPED = (
    "MaxText 0.2.5's tokamax path (use_gmm_v2 false) passes no tiles to tokamax; its gmm v2 "
    "(use_gmm_v2=true) is another kernel, not the one these tiles were set or tuned for"
)


def over_recipe(
    recipe: MaxTextRecipe, trial: MaxTextSettings, platform: Backend = Backend.TPU
) -> MaxTextSettings:
    """The recipe's settings and flags, each kept as written unless the trial's mapped settings
    (`trial`) differ from what the recipe's own configuration maps to: then the trial's."""
    own = to_maxtext(recipe.config(), platform)
    args = dict(recipe.settings)
    for key, value in trial.args.items():
        if own.args.get(key) != value:
            args[key] = value
    for key in own.args.keys() - trial.args.keys():
        args.pop(key, None)
    dropped = set(own.libtpu_init_args) - set(trial.libtpu_init_args)
    flags = [f for f in recipe.libtpu_init_args if f not in dropped]
    flags += [f for f in trial.libtpu_init_args if f not in own.libtpu_init_args and f not in flags]
    unmapped = [u for u in trial.unmapped if u not in own.unmapped]
    return MaxTextSettings(args, flags, unmapped)


def _text(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def _get(tree: dict[str, Any], dotted: str) -> Any:
    node: Any = tree
    for part in dotted.split("."):
        node = node[part]
    return node


def to_maxtext(config: TrialConfig, platform: Backend = Backend.TPU) -> MaxTextSettings:
    """The trial as MaxText settings, for `platform` (where `auto` kernels resolve)."""
    data = config.model_dump(mode="json")
    args: dict[str, str] = {}
    unmapped: list[Unmapped] = []
    for key, value in _model(config, unmapped).items():
        args[key] = value
    for ours, theirs in RENAMED.items():
        args[theirs] = _text(_get(data, ours))
    args["warmup_steps_fraction"] = _text(config.warmup_steps / config.steps)
    args["init_weights_seed"] = _text(config.seed if config.init_seed is None else config.init_seed)
    args.update(FIXED)
    args.update(_remat(config, unmapped))
    args.update(_precision(config.precision, unmapped))
    args.update(_kernels(config, platform, unmapped))
    args.update(_run(config, unmapped))
    defaults = TrialConfig(model=config.model).model_dump(mode="json")
    for name, why in TRAINER_ONLY.items():
        value = _get(data, name)
        if value != _get(defaults, name):
            unmapped.append(Unmapped(name, value, why))
    flags = config.xla.libtpu_init_args()
    gmm = config.resolved_kernels(platform, config.mesh.context).moe_gmm
    if platform == Backend.TPU and config.model.is_moe and gmm == "ragged_dot":
        flags = [RAGGED_DOT_KERNEL, *flags]  # ragged_dot as our trainer runs it on TPU
    return MaxTextSettings(args, flags, unmapped)


def _model(config: TrialConfig, unmapped: list[Unmapped]) -> dict[str, str]:
    model = config.model
    shape = model.model_dump(exclude={"preset", "capacity_factor", "load_balance_loss_weight"})
    name = MODEL_NAMES.get(model.preset or "")
    preset = MODEL_PRESETS.get(model.preset or "", {})
    # (no model MaxText names has our presets' shape with a shared expert beside it)
    if (
        name
        and not model.shared_experts
        and all(shape[k] == v for k, v in preset.items() if k in shape)
    ):
        # MaxText refuses a setting its model config also sets (qwen3-235b-a22b's
        # load_balance_loss_weight) with another value unless told to override it.
        own = preset.get("load_balance_loss_weight", model.load_balance_loss_weight)
        override = model.load_balance_loss_weight != own
        return {"model_name": name, **({"override_model_config": "true"} if override else {})}
    if model.qk_norm:
        unmapped.append(Unmapped("model.qk_norm", True, "MaxText sets QK-norm by model_name"))
    values = {theirs: _text(shape[ours.removeprefix("model.")]) for ours, theirs in SHAPE.items()}
    if model.shared_experts:
        unmapped.append(Unmapped(
            "model.shared_experts", model.shared_experts,
            "the block a custom MoE shape runs as, mixtral's, has no shared expert",
        ))  # fmt: skip
    if model.is_moe:  # every layer an MoE layer: MaxText sizes the experts by base_moe_mlp_dim
        values["base_moe_mlp_dim"] = values["base_mlp_dim"]
        # MaxText's default block (llama2) has a dense MLP whatever num_experts says: without a
        # block with routed experts, MaxText's program was a dense model. Mixtral's is one
        # (every layer top-k routed experts, SwiGLU, as ours).
        values["decoder_block"] = "mixtral"
    else:  # a dense model is one expert to MaxText
        values.update(num_experts="1", num_experts_per_tok="1")
    return {**({"model_name": name, "override_model_config": "true"} if name else {}), **values}


def _remat(config: TrialConfig, unmapped: list[Unmapped]) -> dict[str, str]:
    out: dict[str, str] = {}
    for tensor, place in config.remat.custom.items():
        if tensor in CUSTOM_TENSORS:
            out[tensor] = place
        else:
            unmapped.append(
                Unmapped(
                    f"remat.custom.{tensor}",
                    place,
                    "MaxText places an MoE layer's expert tensors under their dense names "
                    f"({', '.join(t.value for t in EXPERT_TENSORS)})",
                )
            )
    return out


def _precision(precision: PrecisionConfig, unmapped: list[Unmapped]) -> dict[str, str]:
    if precision.mode == "bf16":
        return {}
    quantization = {("e4m3", "e5m2"): "fp8_full", ("e4m3", "e4m3"): "fp8"}.get(
        (precision.forward_format, precision.backward_format)
    )
    if precision.mode == "int8":  # qwix int8 for weights, activations and gradients alike
        quantization = "int8"  # (maxtext/layers/quantizations.py, get_quantization_rule)
    if quantization is None:
        unmapped.append(
            Unmapped(
                "precision.forward_format",
                precision.forward_format,
                "MaxText's fp8 modes run e4m3 forward (fp8_full: e5m2 backward; fp8: e4m3)",
            )
        )
        quantization = "fp8_full"
    calibration = {
        "dynamic": "absmax",
        "fixed": f"fixed,-{precision.fixed_bound:g},{precision.fixed_bound:g}",
    }
    method = calibration.get(precision.scaling, "absmax")
    if precision.scaling == "static":
        unmapped.append(
            Unmapped("precision.scaling", "static", "MaxText sets no static (calibrated) scales")
        )
    if precision.granularity != "per_axis":
        unmapped.append(
            Unmapped(
                "precision.granularity",
                precision.granularity,
                "MaxText's qwix fp8 scales per axis (channelwise); it has no per-tensor or "
                "subchannel setting",
            )
        )
    if precision.targets == "dense":
        unmapped.append(
            Unmapped(
                "precision.targets",
                "dense",
                "MaxText's fp8 modes quantize the experts' grouped matmuls too",
            )
        )
    return {
        "use_qwix_quantization": "true",
        "quantization": quantization,
        "weight_quantization_calibration_method": method,
        "act_quantization_calibration_method": method,
        "bwd_quantization_calibration_method": method,
    }


def _kernels(config: TrialConfig, platform: Backend, unmapped: list[Unmapped]) -> dict[str, str]:
    kernels = config.resolved_kernels(platform, config.mesh.context)
    out = {"attention": ATTENTION[kernels.attention]}
    out.update({theirs: getattr(kernels, ours).upper() for ours, theirs in LAYOUTS.items()})
    out["use_max_logit_estimate"] = _text(
        -1 if kernels.max_logit_const is None else int(kernels.max_logit_const)
    )
    if config.kernels.tune == "time":
        # `compile` is the engine's, before MaxText compiles (trainer/maxtext/tiles.py): MaxText
        # is given the Splash blocks it chose.
        unmapped.append(
            Unmapped(
                "kernels.tune",
                config.kernels.tune,
                "the tuner times our trainer's kernels on a TPU; a MaxText run takes its blocks "
                "as set (`compile` tunes Splash's for MaxText at compile fidelity)",
            )
        )
    if kernels.attention == "splash" and kernels.dq_reduction_steps:
        out["use_tokamax_splash"] = "true"  # MaxText's own Splash has no dQ reduction steps
    if kernels.max_logit_const is not None and kernels.max_logit_const != int(
        kernels.max_logit_const
    ):
        unmapped.append(
            Unmapped(
                "kernels.max_logit_const",
                kernels.max_logit_const,
                "MaxText's use_max_logit_estimate is an integer",
            )
        )
    if not config.model.is_moe:
        return out
    gmm = kernels.moe_gmm
    out["sparse_matmul"] = "true"
    out["megablox"] = _text(gmm == "megablox")
    out["use_tokamax_gmm"] = _text(gmm == "tokamax")
    tiles: dict[str, tuple[int, ...]] = {}
    if gmm == "megablox":
        tiles = {"wi_fwd": (kernels.gmm_tm, kernels.gmm_tk, kernels.gmm_tn),
                 "wo_fwd": (kernels.gmm_tm, kernels.gmm_tk, kernels.gmm_tn)}  # fmt: skip
    elif not kernels.tokamax_tiles.is_default:
        # MaxText 0.2.5 (layers/moe.py, kernels/megablox/ops.py) passes wi_tile_*/wo_tile_* to
        # tokamax only in its gmm v2 (use_gmm_v2=true), another kernel than the one ours
        # tiles; its default tokamax path takes none: written, they would do nothing.
        set_tiles = {k: v for k, v in kernels.tokamax_tiles.model_dump().items() if v}
        unmapped.append(Unmapped("kernels.tokamax_tiles", set_tiles, TOKAMAX_TILES_UNMAPPED))
    for name, sizes in tiles.items():
        out.update({key: str(size) for key, size in zip(GMM_TILE_KEYS[name], sizes, strict=True)})
    return out


def _run(config: TrialConfig, unmapped: list[Unmapped]) -> dict[str, str]:
    out = {"dataset_type": "synthetic"}
    if config.data.source == "stdlib":
        unmapped.append(
            Unmapped(
                "data.source",
                "stdlib",
                "MaxText reads no stdlib corpus: the settings run its synthetic data",
            )
        )
    if config.backend != "auto":
        out["hardware"] = config.backend
    if config.backend == "cpu":  # one process: MaxText's CPU path would wait for a launcher
        out["skip_jax_distributed_system"] = "true"
    if config.profile is not None:  # MaxText's xplane trace of the same steps (kept by the driver)
        out["profiler"] = "xplane"
        out["skip_first_n_steps_for_profiler"] = str(config.profile.start_step)
        out["profiler_steps"] = str(config.profile.steps)
    if config.compile_target:
        topology = Topology.parse(config.compile_target)
        out["compile_topology"] = f"{topology.prefix}-{topology.slice_devices}"
        out["compile_topology_num_slices"] = str(topology.slices)
    return out


# -- back: MaxText settings into a trial configuration ---------------------------------------


def _number(text: str) -> int | float:
    value = float(text)
    return int(value) if value.is_integer() and "." not in text and "e" not in text else value


def _boolean(text: str) -> bool:
    return text.strip().lower() == "true"


def _set(tree: dict[str, Any], dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    for part in parts[:-1]:
        tree = tree.setdefault(part, {})
    tree[parts[-1]] = value


def _read(args: dict[str, str], key: str, parse: Callable[[str], Any] = float) -> Any:
    """A setting's number as the engine reads it; a ConfigError naming it when it is none."""
    try:
        value = parse(args[key])
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(value)
    except (ValueError, TypeError, OverflowError):
        what = "a whole number" if parse is int else "a (finite) number"
        raise ConfigError(key, f"{key}={args[key]} is not {what}; write it as one") from None
    return value


_BOOLEANS = ("mesh.context_load_balance", "model.fused_qkv")
_TEXTS = ("mu_dtype", "remat.policy")
# MaxText's mesh axes the engine's mesh has none of, each read as one of the engine's: as the
# one that shards the weights as it does (FOLDED), else as fsdp (the devices it takes).
OTHER_AXES = tuple(a for a in MAXTEXT_AXES if a not in MESH_AXES)


def from_maxtext(args: dict[str, str], libtpu_init_args: list[str] | None = None) -> dict[str, Any]:
    """The trial configuration (as a dict for `load_config`) that MaxText settings describe:
    the inverse of `to_maxtext` on what it maps. A value the engine cannot read raises
    ConfigError naming the setting."""
    trial: dict[str, Any] = {}
    name = args.get("model_name")
    preset = next((ours for ours, theirs in MODEL_NAMES.items() if theirs == name), None)
    if preset is not None:  # a model MaxText names and we have no preset of: the caller's
        _set(trial, "model.preset", preset)
    for ours, theirs in SHAPE.items():
        if theirs in args:
            parse: Callable[[str], Any] = _boolean if ours in _BOOLEANS else _number
            _set(trial, ours, _read(args, theirs, parse))
    if args.get("num_experts") == "1" and "model_name" not in args:  # dense, to MaxText
        trial["model"].update(num_experts=0, experts_per_token=0)
    for ours, theirs in RENAMED.items():
        if theirs not in args:
            continue
        if ours in _BOOLEANS:
            value: Any = _boolean(args[theirs])
        elif ours in _TEXTS:
            value = args[theirs]
        else:
            value = _read(args, theirs, _number)
        _set(trial, ours, value)
    _fold_mesh(args, trial)
    if "warmup_steps_fraction" in args and "steps" in args:
        fraction = _read(args, "warmup_steps_fraction", float)
        trial["warmup_steps"] = round(fraction * _read(args, "steps", int))
    if "init_weights_seed" in args and args["init_weights_seed"] != args.get("data_shuffle_seed"):
        trial["init_seed"] = _read(args, "init_weights_seed", int)
    custom = {t: args[t] for t in CUSTOM_TENSORS if t in args}
    if custom and args.get("remat_policy") == "custom":  # else MaxText reads none of them
        _set(trial, "remat.custom", custom)
    if _boolean(args.get("use_qwix_quantization", "false")):
        trial["precision"] = _precision_back(args)
    trial.setdefault("kernels", {}).update(_kernels_back(args))
    if args.get("hardware"):
        trial["backend"] = args["hardware"]
    if args.get("compile_topology"):
        prefix, _, devices = args["compile_topology"].rpartition("-")
        slices = (
            _read(args, "compile_topology_num_slices", int)
            if "compile_topology_num_slices" in args
            else 1
        )
        try:
            trial["compile_target"] = slice_target(prefix, int(devices)) + (
                f"x{slices}" if slices > 1 else ""
            )
        except ValueError as exc:
            raise ConfigError(
                "compile_topology", f"compile_topology={args['compile_topology']}: {exc}"
            ) from None
    xla = _flags_back(libtpu_init_args or [])
    if xla:
        trial["xla"] = xla
    return trial


def _fold_mesh(args: dict[str, str], trial: dict[str, Any]) -> None:
    """MaxText's OTHER_AXES into the engine's mesh: fsdp 16 with fsdp_transpose 8 is the
    engine's fsdp 128; a -1 (fill what the others leave) stays -1 and fills both."""
    for theirs in OTHER_AXES:
        ours = FOLDED.get(theirs, "fsdp")
        key = f"ici_{theirs}_parallelism"
        if key not in args:
            continue
        degree = _read(args, key, _number)
        mesh = trial.setdefault("mesh", {})
        into = mesh.get(ours, -1 if ours == "fsdp" else 1)  # MaxText's defaults, as ours
        if degree == -1:
            mesh[ours] = -1
        elif degree != 1 and into != -1:
            mesh[ours] = into * degree


def _precision_back(args: dict[str, str]) -> dict[str, Any]:
    precision: dict[str, Any] = {"mode": "fp8", "granularity": "per_axis"}
    quantization = args.get("quantization", "")
    if quantization not in ("fp8", "fp8_full", "int8"):
        raise ConfigError(
            "quantization",
            f"quantization={quantization}: the engine reads MaxText's qwix modes fp8, "
            "fp8_full and int8 as its precision; take one of them, or import the command "
            "without use_qwix_quantization",
        )
    if quantization == "int8":
        precision["mode"] = "int8"
    elif quantization == "fp8":
        precision["backward_format"] = "e4m3"
    method = args.get("weight_quantization_calibration_method", "absmax")
    if method.startswith("fixed"):
        precision["scaling"] = "fixed"
        bound = method.split(",")[-1]
        try:
            precision["fixed_bound"] = float(bound)
        except ValueError:
            raise ConfigError(
                "weight_quantization_calibration_method",
                f"weight_quantization_calibration_method={method}: a fixed range is written "
                "fixed,-BOUND,BOUND (e.g. fixed,-224,224)",
            ) from None
    return precision


def _kernels_back(args: dict[str, str]) -> dict[str, Any]:
    kernels: dict[str, Any] = {}
    if "attention" in args:
        back = {v: k for k, v in ATTENTION.items()}
        if args["attention"] not in back:
            raise ConfigError(
                "attention",
                f"attention={args['attention']}: the engine's attention kernels are MaxText's "
                f"{', '.join(back)}; take one of them",
            )
        kernels["attention"] = back[args["attention"]]
    for ours, theirs in LAYOUTS.items():
        if theirs in args:
            kernels[ours] = args[theirs].lower()
    estimate = (
        int(_read(args, "use_max_logit_estimate", float))
        if "use_max_logit_estimate" in args
        else -1
    )
    if estimate != -1:
        kernels["max_logit_const"] = float(estimate)
    if "megablox" in args or "use_tokamax_gmm" in args:
        # MaxText 0.2.5 (layers/moe.py): use_tokamax_gmm runs tokamax whatever megablox says;
        # else megablox (its base.yml's default: true) runs megablox; else XLA's ragged_dot.
        if _boolean(args.get("use_tokamax_gmm", "false")):  # its tiles reach no kernel
            kernels["moe_gmm"] = "tokamax"
        elif _boolean(args.get("megablox", "true")):
            kernels["moe_gmm"] = "megablox"
            if all(k in args for k in GMM_TILE_KEYS["wi_fwd"]):  # else base.yml's, as ours
                tm, tk, tn = (_read(args, k, int) for k in GMM_TILE_KEYS["wi_fwd"])
                kernels.update(gmm_tm=tm, gmm_tk=tk, gmm_tn=tn)
        else:
            kernels["moe_gmm"] = "ragged_dot"
    return kernels


def _flags_back(flags: list[str]) -> dict[str, Any]:
    """LIBTPU_INIT_ARGS as the xla section: the scoped VMEM limit, a whole collective bundle,
    the rest as extra flags (`XlaFlagsConfig.libtpu_init_args` inverted)."""
    rest = [f for f in flags if f != RAGGED_DOT_KERNEL]  # to_maxtext's, for moe_gmm ragged_dot
    xla: dict[str, Any] = {}
    prefix = "--xla_tpu_scoped_vmem_limit_kib="
    vmem = [f for f in rest if f.startswith(prefix)]
    if vmem:
        xla["scoped_vmem_kib"] = int(vmem[0].removeprefix(prefix))
        rest.remove(vmem[0])
    for mode, bundle in (
        ("sparsecore_offload", SPARSECORE_OFFLOAD),
        ("async_fusion", ASYNC_FUSION),
    ):
        if all(f in rest for f in bundle):
            xla["collective_mode"] = mode
            rest = [f for f in rest if f not in bundle]
            break
    if rest:
        xla["extra"] = rest
    return xla


def slice_target(prefix: str, devices: int) -> str:
    """A compile_topology (`tpu7x-128`) as our target (`tpu7x:4x4x4`)."""
    try:
        return standard_slice(prefix, devices)
    except ValueError as exc:
        raise ValueError(f"compile_topology {exc}") from None
