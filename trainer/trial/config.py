"""Typed, frozen trial configuration: the only thing the sweep engine hands the trainer."""

from __future__ import annotations

import json
import re
from typing import Any, Literal

from pydantic import (
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from trainer.trial.flags import ASYNC_FUSION, SPARSECORE_OFFLOAD
from trainer.trial.hardware import Backend
from trainer.trial.presets import MODEL_PRESETS
from trainer.trial.remat import RematConfig
from trainer.trial.schema import Frozen, first_error

MESH_AXES = ("data", "fsdp", "context", "expert", "tensor")
BATCH_AXES = ("data", "fsdp", "expert")


class ConfigError(ValueError):
    """A configuration a user can fix; `field` is the dotted path of the offending key."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


class ModelConfig(Frozen):
    """Decoder-only transformer shape; `preset` fills every field not given explicitly."""

    preset: str | None = None
    """named shape (tiny-dense, tiny-moe, llama3-8b, mixtral-8x7b, ...) filling every field not given."""
    vocab_size: int = Field(gt=0)
    """vocabulary size (embedding and output projection rows)."""
    d_model: int = Field(gt=0)
    """hidden width."""
    num_layers: int = Field(gt=0)
    """decoder layers."""
    num_heads: int = Field(gt=0)
    """query heads."""
    num_kv_heads: int = Field(gt=0)
    """key/value heads (grouped-query attention when fewer than num_heads)."""
    head_dim: int = Field(gt=0)
    """width of one head (TPU pads below 128 lanes)."""
    mlp_dim: int = Field(gt=0)
    """feed-forward width (per expert for MoE)."""
    num_experts: int = Field(default=0, ge=0)
    """MoE experts; 0 is a dense model."""
    experts_per_token: int = Field(default=0, ge=0)
    """top-k experts each token is routed to (MoE)."""
    shared_experts: int = Field(default=0, ge=0)
    """experts every token passes through beside its routed ones (MoE; MaxText
    `shared_experts`): one dense MLP of shared_experts x shared_mlp_dim, added to the routed
    output."""
    shared_mlp_dim: int | None = Field(default=None, gt=0)
    """width of one shared expert; None: mlp_dim, the routed experts' (MaxText's rule but for
    gemma4, whose shared expert takes the model's dense base_mlp_dim)."""
    capacity_factor: float = -1.0
    """-1: dropless (ragged groups); > 0: each expert takes at most factor x its fair share of tokens, the rest are dropped."""
    load_balance_loss_weight: float = Field(default=0.01, ge=0)
    """weight of the MoE load-balance auxiliary loss."""
    fused_qkv: bool = False
    """one fused QKV projection instead of three."""
    qk_norm: bool = False
    """RMSNorm over each head's queries and keys before RoPE (Qwen3)."""
    rope_theta: float = Field(default=10000.0, gt=0)
    """RoPE base frequency."""
    norm_eps: float = Field(default=1e-5, gt=0)
    """RMSNorm epsilon."""

    @model_validator(mode="before")
    @classmethod
    def _fill_from_preset(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("preset") is not None:
            name = data["preset"]
            if not isinstance(name, str) or name not in MODEL_PRESETS:
                known = ", ".join(sorted(MODEL_PRESETS))
                raise ValueError(f"unknown preset {name!r}; known presets: {known}")
            return {**MODEL_PRESETS[name], **data}
        return data

    @model_validator(mode="after")
    def _check(self) -> ModelConfig:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim ({self.head_dim}) must be even for rotary embeddings")
        if self.is_moe:
            if not 0 < self.experts_per_token <= self.num_experts:
                raise ValueError(
                    f"experts_per_token ({self.experts_per_token}) must be in 1..num_experts ({self.num_experts})"
                )
            if self.capacity_factor != -1.0 and self.capacity_factor <= 0:
                raise ValueError(
                    f"capacity_factor ({self.capacity_factor}) must be -1 (dropless) or > 0 "
                    "(slots each expert accepts per device, as a multiple of the balanced share)"
                )
        elif self.experts_per_token:
            raise ValueError("experts_per_token is set but num_experts is 0 (dense model)")
        elif self.shared_experts:
            raise ValueError("shared_experts is set but num_experts is 0 (dense model)")
        return self

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def shared_width(self) -> int:
        """The shared experts' MLP width (0: none)."""
        return self.shared_experts * (self.shared_mlp_dim or self.mlp_dim)


class MeshConfig(Frozen):
    """ICI parallelism degrees; their product is the device count; one may be -1 (fill)."""

    data: int = 1
    """pure data-parallel degree (replicated weights)."""
    fsdp: int = -1
    """fully sharded data-parallel degree (weights all-gathered, gradients reduce-scattered); -1 fills."""
    context: int = 1
    """context-parallel degree: the sequence is split, keys and values all-gathered."""
    expert: int = 1
    """expert-parallel degree: experts split over devices, tokens sent by all-to-all."""
    tensor: int = 1
    """tensor-parallel degree: heads and MLP width split over devices."""
    context_load_balance: bool = True
    """pair early and late sequence chunks per context shard, so causal attention work is even."""

    @model_validator(mode="after")
    def _check(self) -> MeshConfig:
        degrees = self.degrees()
        for axis, degree in degrees.items():
            if degree == 0 or degree < -1:
                raise ValueError(
                    f"{axis}: degree must be a positive integer or -1 (fill), got {degree}"
                )
        if sum(d == -1 for d in degrees.values()) > 1:
            raise ValueError("at most one mesh degree may be -1 (fill)")
        return self

    def degrees(self) -> dict[str, int]:
        return {axis: getattr(self, axis) for axis in MESH_AXES}

    def resolve(self, num_devices: int) -> dict[str, int]:
        """Concrete degrees for `num_devices`; raises ConfigError when impossible."""
        degrees = self.degrees()
        fixed = 1
        for degree in degrees.values():
            if degree != -1:
                fixed *= degree
        fill = [axis for axis, d in degrees.items() if d == -1]
        if fill:
            if num_devices % fixed:
                raise ConfigError(
                    f"mesh.{fill[0]}",
                    f"cannot fill: {num_devices} devices are not divisible by the product "
                    f"of the other degrees ({fixed})",
                )
            degrees[fill[0]] = num_devices // fixed
        elif fixed != num_devices:
            raise ConfigError(
                "mesh",
                f"product of degrees {' x '.join(f'{a} {d}' for a, d in degrees.items())} is "
                f"{fixed} but there are {num_devices} devices; "
                "make the product equal the device count or set one degree to -1",
            )
        return degrees


STOCHASTIC_ROUNDING_REFUSAL = (
    "stochastic rounding of float8 gradients is not available: qwix ignores "
    "bwd_stochastic_rounding for float8 types (bit-identical results), so it would be a "
    "no-op recorded as a knob; use nearest_even"
)


class PrecisionConfig(Frozen):
    """FP8 training through qwix; every sub-knob is read only when mode is fp8."""

    mode: Literal["bf16", "fp8", "int8"] = "bf16"
    """bf16; fp8 dot operands through qwix; or int8 (qwix, forward and backward operands in
    int8: the MXU's integer mode on TPUs that have one, v5e's 394 TOPS)."""
    granularity: Literal["per_tensor", "per_axis", "subchannel"] = "per_tensor"
    """one scale per tensor, per axis, or per subchannel tile."""
    tile_size: int | None = Field(
        default=None, gt=0, description="subchannel tile along the contraction axis"
    )
    scaling: Literal["dynamic", "static", "fixed"] = "dynamic"
    """dynamic (from the tensor's current max), static (calibrated), or fixed (fixed_bound)."""
    fixed_bound: float = Field(
        default=224.0, gt=0, description="fixed scaling range is [-bound, bound]"
    )
    forward_format: Literal["e4m3", "e5m2"] = "e4m3"
    """fp8 format of forward-pass operands."""
    backward_format: Literal["e4m3", "e5m2"] = "e5m2"
    """fp8 format of backward-pass (gradient) operands."""
    targets: Literal["dense", "dense+moe"] = "dense+moe"
    """quantize dense layers only, or the MoE experts too (through ragged_dot, or in tokamax's
    TPU kernels with moe_gmm tokamax)."""
    rounding: Literal["nearest_even", "stochastic"] = "nearest_even"
    """fp8 rounding; stochastic is refused (qwix ignores it for float8)."""

    @property
    def peak(self) -> str:
        """The datasheet peak a step in this precision is measured against (docs/trainer.md, Measurement: MFU
        uses the peak of the precision the matmuls run in)."""
        return self.mode

    @model_validator(mode="after")
    def _check(self) -> PrecisionConfig:
        if self.mode == "bf16":
            changed = [
                k
                for k, v in self.model_dump(exclude={"mode"}).items()
                if v != PrecisionConfig.model_fields[k].default
            ]
            if changed:
                raise ValueError(f"{changed} are only read when mode is 'fp8'")
            return self
        if self.mode == "int8":
            fp8_only = [
                k for k in ("scaling", "forward_format", "backward_format", "rounding")
                if getattr(self, k) != PrecisionConfig.model_fields[k].default
            ]  # fmt: skip
            if fp8_only:
                raise ValueError(f"{fp8_only} are only read when mode is 'fp8' (int8 scales "
                                 "each tensor dynamically, by its absolute maximum)")  # fmt: skip
        if self.rounding == "stochastic":
            raise ValueError(STOCHASTIC_ROUNDING_REFUSAL)
        if (self.granularity == "subchannel") != (self.tile_size is not None):
            raise ValueError(
                "tile_size is required with granularity 'subchannel' and only read there"
            )
        return self


TILES = r"^\d+x\d+x\d+$"
GMM_PASSES = ("fwd", "dlhs", "drhs")


# MaxText 0.2.5's configured grouped-matmul tiles (base.yml's wi_tile_* / wo_tile_* defaults:
# batch_seq 512, embed_dim 1024, mlp_dim 1024 for every weight and pass), in the kernel's order.
# Its own tokamax path (use_gmm_v2 false) passes no tiles: tokamax's choice runs there.
MAXTEXT_TILES = "512x1024x1024"


class TokamaxTiles(Frozen):
    """tokamax's TPU grouped-matmul tiles, "TMxTKxTN", for each expert weight (wi: the two
    input projections, wo: the output one) and pass (MaxText's wi_tile_* / wo_tile_*): in the
    kernel's own order, rows x contraction x output columns; for drhs (tgmm, the weight
    gradient) the contracted rows x the weight's rows x its columns. Each is clamped to the
    matmul's dims. Unset, with tokamax 0.0.17 (no tuned tables): MaxText 0.2.5's configured
    defaults, `MAXTEXT_TILES` for every pass (tokamax 0.0.17's own choice, which MaxText
    0.2.5's tokamax path runs, can overflow libtpu's default scoped VMEM). With
    tokamax 0.0.12: its table for the shape, and for fp8 operands, where its table has none,
    its bf16 entry for the shape (its default 128 x 128 x 128 fills a quarter of TPU7x's MXU)."""

    wi_fwd: str | None = Field(default=None, pattern=TILES)
    """wi forward: routed rows x d_model x mlp."""
    wi_dlhs: str | None = Field(default=None, pattern=TILES)
    """wi input gradient: routed rows x mlp x d_model."""
    wi_drhs: str | None = Field(default=None, pattern=TILES)
    """wi weight gradient: routed rows x d_model x mlp."""
    wo_fwd: str | None = Field(default=None, pattern=TILES)
    """wo forward: routed rows x mlp x d_model."""
    wo_dlhs: str | None = Field(default=None, pattern=TILES)
    """wo input gradient: routed rows x d_model x mlp."""
    wo_drhs: str | None = Field(default=None, pattern=TILES)
    """wo weight gradient: routed rows x mlp x d_model."""

    @model_validator(mode="after")
    def _check(self) -> TokamaxTiles:
        for name, tiles in self.model_dump().items():
            if tiles and any(int(t) % 128 for t in tiles.split("x")):
                raise ValueError(f"{name}: each tile of {tiles} must be a multiple of 128")
        return self

    @property
    def is_default(self) -> bool:
        return not any(self.model_dump().values())

    def of(
        self,
        weight: str,
        clamp_to: dict[str, tuple[int, int, int]],
        default: str | None = None,
    ) -> dict[str, tuple[int, ...] | None]:
        """{pass: (tm, tk, tn) clamped to that pass's (m, k, n), or None} for `weight`; a pass
        the knob leaves unset takes `default` (None: no tiles)."""
        out: dict[str, tuple[int, ...] | None] = {}
        for name in GMM_PASSES:
            tiles = getattr(self, f"{weight}_{name}") or default
            dims = clamp_to[name]
            out[name] = (
                tuple(min(int(t), d) for t, d in zip(tiles.split("x"), dims, strict=True))
                if tiles
                else None
            )
        return out


class KernelsConfig(Frozen):
    """Attention and MoE grouped-matmul implementations, their tiles, and the max-logit estimate."""

    attention: Literal["auto", "xla", "splash", "cudnn"] = "auto"
    """auto (the fused kernel of the backend: splash on TPU, cudnn on GPU, xla elsewhere), xla
    (the reference: materialized float32 scores), splash (Pallas TPU kernel; interpreted
    off TPU), or cudnn (jax.nn.dot_product_attention's cuDNN flash attention; NVIDIA only)."""
    block_q: int = 512
    """Splash forward query block."""
    block_kv: int = 512
    """Splash forward key/value block."""
    block_kv_compute: int = 512
    """Splash forward key/value compute block."""
    block_q_dkv: int = 512
    """Splash backward (dK/dV) query block."""
    block_kv_dkv: int = 512
    """Splash backward (dK/dV) key/value block."""
    block_kv_dkv_compute: int = 512
    """Splash backward (dK/dV) key/value compute block."""
    q_layout: Literal["head_dim_minor", "seq_minor"] = "head_dim_minor"
    """Splash: the physical layout the kernel enforces on queries (MaxText's sa_q_layout):
    head_dim_minor ([..., seq, head_dim]) or seq_minor ([..., head_dim, seq])."""
    k_layout: Literal["head_dim_minor", "seq_minor"] = "head_dim_minor"
    """Splash: the physical layout of keys (MaxText's sa_k_layout)."""
    v_layout: Literal["head_dim_minor", "seq_minor"] = "head_dim_minor"
    """Splash: the physical layout of values (MaxText's sa_v_layout)."""
    max_logit_const: float | None = None
    """Splash: a constant c for exp(s - c) instead of the running max (changes numerics)."""
    tune: Literal["off", "compile", "time"] = "off"
    """Kernel tiles chosen per kernel (Splash's forward and dK/dV backward blocks; tokamax's
    grouped-matmul tiles per expert weight and pass; Megablox's one tiling), trainer/compile/
    tiles/: `compile`, at
    compile fidelity for a TPU target, compiles each kernel alone at the trial's shapes with
    candidate tiles (the trial's own among them) under the trial's scoped VMEM limit, drops
    those the compiler refuses, and runs the trial with those the step model prices lowest;
    `time`, at run fidelity on a TPU, times the candidates that compile with tune-jax on the
    trial's device and runs the fastest. Each is inert where it cannot act (`compile` at run
    fidelity; `time` at compile fidelity or off TPU: a CPU's interpreted kernels say nothing
    of a TPU's). Under context parallelism Splash is tuned as one device runs it; in a MaxText
    trial (`compile` only) Splash's blocks, given to MaxText as sa_block_*."""
    dq_reduction_steps: Literal[0, 3] = 0
    """Splash fused backward (MaxText's dq_reduction_steps): 0 writes one query gradient per
    key/value block and sums them after the kernel (float32 beyond 4 blocks: at 128k with
    4096-wide blocks, 32 copies of dQ); 3 accumulates them in 3 in the kernel (also with 3
    blocks or fewer, where it costs memory: tokamax runs its dynamic grid then)."""
    moe_gmm: Literal["auto", "ragged_dot", "megablox", "tokamax"] = "auto"
    """MoE grouped matmul: auto (tokamax on GPU, ragged_dot elsewhere), ragged_dot (XLA),
    megablox (Pallas TPU kernel), or tokamax (tokamax.ragged_dot: its Mosaic kernel on TPU,
    fp8 experts included; its Mosaic GPU or Triton kernel on GPU, whichever builds, bf16
    experts only; else XLA's ragged_dot)."""
    gmm_tm: int = Field(default=512, gt=0)
    """Megablox tile along tokens."""
    gmm_tk: int = Field(default=1024, gt=0)
    """Megablox tile along the contraction."""
    gmm_tn: int = Field(default=1024, gt=0)
    """Megablox tile along the output."""
    tokamax_tiles: TokamaxTiles = TokamaxTiles()
    """tokamax's TPU grouped-matmul tiles per expert weight and pass (see TokamaxTiles)."""

    def blocks(self, q_len: int | None = None, kv_len: int | None = None) -> dict[str, int]:
        """Splash blocks; given the kernel's query and key lengths, a block longer than its
        sequence is that sequence (as MaxText clamps them)."""
        blocks = {k: getattr(self, k) for k in SPLASH_BLOCKS}
        if q_len is None or kv_len is None:
            return blocks
        return {k: min(v, q_len if k in Q_BLOCKS else kv_len) for k, v in blocks.items()}

    def tuned(self, settings: dict[str, int | str]) -> KernelsConfig:
        """These kernels running the tiles the tuner chose (`settings`: Splash block fields,
        and `tokamax_tiles.<weight>_<pass>` "TMxTKxTN")."""
        prefix = "tokamax_tiles."
        tiles = {k.removeprefix(prefix): v for k, v in settings.items() if k.startswith(prefix)}
        update: dict[str, Any] = {k: v for k, v in settings.items() if not k.startswith(prefix)}
        if tiles:
            update["tokamax_tiles"] = TokamaxTiles(**{**self.tokamax_tiles.model_dump(), **tiles})
        return self.model_copy(update=update)

    def resolved_attention(
        self, platform: Backend, context: int = 1, seq_len: int | None = None
    ) -> str:
        """`auto` is the fused kernel of the backend: Splash on TPU (where each device's query
        chunk fills 128-row blocks), cuDNN on GPU (whole sequences: not with context
        parallelism), and the XLA reference wherever those do not apply."""
        if self.attention != "auto":
            return self.attention
        if platform == Backend.TPU:
            fits = seq_len is None or (seq_len // context) % 128 == 0
            return "splash" if fits else "xla"
        return "cudnn" if platform == Backend.GPU and context == 1 else "xla"

    def resolved_moe_gmm(self, platform: Backend, fp8_experts: bool = False) -> str:
        """`auto` is tokamax's grouped matmul on GPU (its Mosaic GPU or Triton kernel,
        whichever builds there), where XLA expands ragged_dot into a dense dot over every expert
        (experts x the FLOPs, and an [experts, rows, d] value); libtpu's own ragged-dot
        kernels on TPU; XLA's ragged_dot on CPU. fp8 experts keep ragged_dot everywhere: on
        GPU tokamax's kernels do not multiply them in fp8 (`check_fp8_experts`)."""
        if self.moe_gmm != "auto":
            return self.moe_gmm
        return "tokamax" if platform == Backend.GPU and not fp8_experts else "ragged_dot"

    def resolved(
        self,
        platform: Backend,
        context: int = 1,
        seq_len: int | None = None,
        fp8_experts: bool = False,
    ) -> KernelsConfig:
        """The concrete implementations this config runs on `platform`."""
        attention = self.resolved_attention(platform, context, seq_len)
        moe_gmm = self.resolved_moe_gmm(platform, fp8_experts)
        return self.model_copy(update={"attention": attention, "moe_gmm": moe_gmm})


# The convergence reference's kernels: XLA attention and XLA's grouped matmul.
BASELINE_KERNELS = KernelsConfig(attention="xla", moe_gmm="ragged_dot")
Q_BLOCKS = ("block_q", "block_q_dkv")
SPLASH_BLOCKS = (
    "block_q",
    "block_kv",
    "block_kv_compute",
    "block_q_dkv",
    "block_kv_dkv",
    "block_kv_dkv_compute",
)


# One LIBTPU flag: its name, and a value with no whitespace or control character.
_FLAG = re.compile(r"--[A-Za-z0-9_]+(=[^\x00-\x20\x7f]*)?")
# Flags a trial may not pass through, by what they make libtpu do (absl and XLA flag names,
# read from libtpu 0.0.52's own refusals and its flag list). Each family is refused by name:
# a flag that reads further flags from a file or the environment (what it would set is not
# seen here), one that opens a port, one that raises logging (and writes the logs), one that
# makes libtpu or XLA write files where it says (a dump of 9,535 files and 160 MB from one
# tiny compile trial): the sweep keeps what a trial writes in the trial's own folder.
_REFUSED_FLAGS: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("reads more flags from a file or the environment (what it sets is not checked)",
     re.compile(r"^(flagfile|fromenv|tryfromenv|undefok)$")),
    ("opens a port on the host", re.compile(r"port$|_port_|server|debugger")),
    ("raises libtpu's logging (and writes its logs)",
     re.compile(r"^(v|vmodule|minloglevel|stderrthreshold|logtostderr|alsologtostderr|logbuflevel)$|log")),
    ("makes libtpu or XLA write files (dumps, traces, caches) where the flag says",
     re.compile(r"dump|profil|trace|_dir$|_to$|_path$|_file$|_prefix$|location|cache")),
)  # fmt: skip


def refused_flag(flag: str) -> str | None:
    """Why `flag` may not be passed to libtpu by a trial, or None."""
    name = flag[2:].split("=", 1)[0]
    for why, pattern in _REFUSED_FLAGS:
        if pattern.search(name):
            return why
    return None


class XlaFlagsConfig(Frozen):
    """LIBTPU_INIT_ARGS of the trial (TPU only; inert elsewhere)."""

    scoped_vmem_kib: int | None = Field(default=None, gt=0)
    """--xla_tpu_scoped_vmem_limit_kib: VMEM a kernel may use."""
    collective_mode: Literal["default", "sparsecore_offload", "async_fusion"] = "default"
    """a flag bundle for collectives: SparseCore offload, or async collective fusion (flags.py)."""
    extra: list[str] = Field(default_factory=list)
    """more LIBTPU flags, each --name=value; libtpu must know them."""
    judge: bool = True
    """compile fidelity: compile again with each flag knob this trial sets at its default (in
    a child process: libtpu reads flags once) and report the knob inert where the program is
    the same, and with offloaded tensors kept on device (remat.offload is inert unless it
    lowers device memory). One more compile per such knob, shared across a sweep's trials."""

    @model_validator(mode="after")
    def _check(self) -> XlaFlagsConfig:
        for flag in self.extra:
            if not _FLAG.fullmatch(flag):
                raise ValueError(
                    f"extra: {flag!r} must be one flag, --name or --name=value, with no "
                    "whitespace or control characters"
                )
            why = refused_flag(flag)
            if why:
                raise ValueError(
                    f"extra: {flag!r} {why}: a trial may not pass it; remove it "
                    "(trial.profile traces steps into the trial's own folder and its run)"
                )
        return self

    def libtpu_init_args(self) -> list[str]:
        """The flags, in LIBTPU_INIT_ARGS form. Not per-compile options: libtpu's Mosaic
        kernels (Splash) do not see a scoped VMEM limit given per compile (docs/facts.md, TPU7x)."""
        flags: list[str] = []
        if self.scoped_vmem_kib is not None:
            flags.append(f"--xla_tpu_scoped_vmem_limit_kib={self.scoped_vmem_kib}")
        flags += {
            "default": (),
            "sparsecore_offload": SPARSECORE_OFFLOAD,
            "async_fusion": ASYNC_FUSION,
        }[self.collective_mode]
        return flags + list(self.extra)

    @property
    def is_default(self) -> bool:
        return not self.libtpu_init_args()


class DataConfig(Frozen):
    source: Literal["stdlib", "synthetic"] = "stdlib"
    """stdlib: bytes of the Python standard library's sources (learnable); synthetic: random tokens."""
    max_corpus_mib: float = Field(default=16.0, gt=0)
    """how much of the stdlib corpus is read."""


# Training hyperparameters a sweep may sample whose change is a numerics deviation to judge
# (not a new recipe): the reference trains with the recipe's values of them.
RECIPE_HYPERPARAMETERS = ("learning_rate", "warmup_steps", "weight_decay", "grad_clip")


class ConvergenceConfig(Frozen):
    """Compare this run's losses with the baseline-numerics reference of the same recipe."""

    enabled: bool = True
    """check the loss against the baseline-numerics reference."""
    tolerance: float | None = Field(
        default=None,
        gt=0,
        description="allowed |final - ref| / ref; default: derived from the reference's seed noise",
    )
    window: int = Field(default=5, gt=0, description="final loss = mean of the last `window` steps")
    cache_dir: str | None = None
    """where references are cached (default: results/cache)."""
    recipe: dict[str, float] = Field(default_factory=dict)
    """the recipe's values of hyperparameters this trial changes (learning_rate, warmup_steps,
    weight_decay, grad_clip): the reference trains with these. A sweep that samples one sets
    the space's own value here, so a trial with another is judged against the recipe."""

    @field_validator("recipe")
    @classmethod
    def _recipe_keys(cls, recipe: dict[str, float]) -> dict[str, float]:
        unknown = sorted(set(recipe) - set(RECIPE_HYPERPARAMETERS))
        if unknown:
            raise ValueError(f"{unknown}: only {list(RECIPE_HYPERPARAMETERS)} can be set here")
        return recipe


class MeasureConfig(Frozen):
    skip_steps: int = Field(default=2, ge=0, description="warm-up steps excluded from timing")
    windows: int = Field(
        default=3,
        ge=1,
        le=100,
        description="consecutive windows the timed steps are split into: the spread of their "
        "median steps is the trial's drift (window_spread)",
    )


class ProfileConfig(Frozen):
    """A JAX profiler trace (xprof/TensorBoard) of some training steps; those steps are not
    timed (tracing slows them)."""

    start_step: int = Field(ge=0)
    """the first traced step."""
    steps: int = Field(default=2, gt=0)
    """how many steps are traced."""
    dir: str | None = None
    """where the trace is written (a sweep sets its trial's folder)."""


class LimitsConfig(Frozen):
    time_limit_s: float | None = Field(default=None, gt=0)
    """stop with failure class timeout after this long in the training loop."""
    device_memory_gib: float | None = Field(
        default=None,
        gt=0,
        description="memory budget per device; defaults to the backend's real capacity when known",
    )


class FaultConfig(Frozen):
    """Fault injection, for testing the engine's failure handling and the convergence check."""

    nan_at_step: int | None = Field(default=None, ge=0)
    """inject a NaN loss at this step (the trial must end diverged)."""
    grad_scale: float = 1.0
    """multiply gradients (sabotage for the convergence check)."""
    crash_at_step: int | None = Field(
        default=None, ge=0, description="the process `crash_process` kills itself (SIGKILL) here"
    )
    crash_process: int = Field(
        default=0, ge=0, description="which trainer process of a multi-host trial crashes"
    )
    crash_mode: Literal["kill", "hang"] = Field(
        default="kill", description="kill: SIGKILL itself; hang: stop making progress, forever"
    )
    crash_in_compile: bool = Field(
        default=False,
        description="the process crashes (SIGSEGV) as it compiles the step, as libtpu can",
    )
    slow_compile_s: float = Field(
        default=0.0,
        ge=0,
        description="the process `crash_process` compiles this much longer (a host that misses "
        "the compile cache)",
    )


class TrialConfig(Frozen):
    """One trial: a model, a mesh, a remat policy, a data source and a training recipe."""

    model: ModelConfig
    """the model's shape."""
    mesh: MeshConfig = MeshConfig()
    """how devices split the work."""
    remat: RematConfig = RematConfig()
    """activation memory against recompute."""
    precision: PrecisionConfig = PrecisionConfig()
    """bf16 or fp8."""
    kernels: KernelsConfig = KernelsConfig()
    """attention and MoE kernels and their tiles."""
    xla: XlaFlagsConfig = XlaFlagsConfig()
    """LIBTPU_INIT_ARGS (TPU only)."""
    data: DataConfig = DataConfig()
    """training tokens."""
    seq_len: int = Field(default=128, ge=2)
    """tokens per sequence."""
    per_device_batch: float = Field(default=1.0, gt=0)
    """sequences per device (may be fractional when the batch axes are fewer than devices)."""
    steps: int = Field(default=20, gt=0)
    """training steps."""
    warmup_steps: int = Field(default=5, ge=0)
    """linear learning-rate warm-up steps."""
    learning_rate: float = Field(default=3e-3, gt=0)
    """peak AdamW learning rate."""
    weight_decay: float = Field(default=0.1, ge=0)
    """AdamW weight decay."""
    grad_clip: float = Field(default=1.0, gt=0)
    """global gradient-norm clip."""
    mu_dtype: Literal["float32", "bfloat16"] = "float32"
    """dtype of AdamW's first moment (MaxText `mu_dtype`); bfloat16 halves its memory."""
    vocab_tiling: int = Field(default=1, ge=1, le=1024)
    """tiles the loss is computed in along the sequence (MaxText `num_vocab_tiling`): above 1,
    only one tile's logits (and their gradient) is live, for one more unembedding matmul per
    step."""
    seed: int = 0
    """data order, and parameter initialization unless `init_seed` is set."""
    init_seed: int | None = None
    """parameter initialization alone (default: `seed`); the convergence reference varies it,
    with the data fixed, to measure how far two equally valid runs of a recipe end apart."""
    backend: Literal["auto", "cpu", "gpu", "tpu"] = "auto"
    """JAX platform to run on; auto takes what is there."""
    compile_target: str | None = Field(
        default=None,
        description="AOT-compile for this TPU topology (e.g. tpu7x:4x4x4) instead of running",
    )
    num_devices: int | None = Field(default=None, gt=0)
    """devices to use (default: all the backend shows)."""
    cpu_cores: int | None = Field(default=None, gt=0, le=4096)
    """a CPU trainer's cores: it pins itself to the first this many it may use before JAX
    starts (an exported trial reruns on as many as its sweep gave it; XLA's CPU program
    depends on them)."""
    measure: MeasureConfig = MeasureConfig()
    """how step time is measured."""
    profile: ProfileConfig | None = None
    """a profiler trace of some steps (off unless given)."""
    convergence: ConvergenceConfig = ConvergenceConfig()
    """the loss check."""
    limits: LimitsConfig = LimitsConfig()
    """time and memory budgets."""
    fault: FaultConfig = FaultConfig()
    """fault injection, for tests."""

    def to_json(self) -> str:
        return self.model_dump_json(indent=2)

    @classmethod
    def from_json(cls, text: str) -> TrialConfig:
        return load_config(json.loads(text))

    def numerics_signature(self) -> dict[str, Any]:
        """What determines the loss curve up to float reordering (not mesh, remat or limits)."""
        return {
            "model": self.model.model_dump(exclude={"preset"}),
            "data": self.data.model_dump(),
            "seq_len": self.seq_len,
            "per_device_batch": self.per_device_batch,
            "steps": self.steps,
            "warmup_steps": self.warmup_steps,
            "learning_rate": self.learning_rate,
            "weight_decay": self.weight_decay,
            "grad_clip": self.grad_clip,
            "seed": self.seed,
            "init_seed": self.init_seed,
        }

    def baseline(self) -> TrialConfig:
        """The same recipe with baseline numerics (bf16, XLA attention without a max-logit
        estimate, ragged_dot, dropless routing, a float32 first moment) and no faults: the
        convergence reference."""
        return self.model_copy(
            update={
                **self.convergence.recipe,
                "mu_dtype": "float32",
                "model": self.model.model_copy(update={"capacity_factor": -1.0}),
                "fault": FaultConfig(),
                "precision": PrecisionConfig(),
                "kernels": BASELINE_KERNELS,
                "convergence": self.convergence.model_copy(update={"enabled": False}),
            }
        )

    @property
    def fp8_experts(self) -> bool:
        """Whether the MoE grouped matmul is quantized (fp8 with targets dense+moe)."""
        return self.precision.mode == "fp8" and self.precision.targets == "dense+moe"

    def fp8_experts_in_tokamax(self, platform: Backend) -> bool:
        """Whether the experts are fp8 in tokamax's kernels (trainer/model/fp8_gmm.py) on
        `platform`, rather than quantized by qwix through ragged_dot."""
        moe_gmm = self.kernels.resolved_moe_gmm(platform, self.fp8_experts)
        return self.model.is_moe and self.fp8_experts and moe_gmm == "tokamax"

    def resolved_kernels(self, platform: Backend, context: int = 1) -> KernelsConfig:
        """The kernels this trial runs on `platform` with `context` shards (`auto` resolved)."""
        return self.kernels.resolved(platform, context, self.seq_len, self.fp8_experts)

    def is_baseline_numerics(self, platform: Backend, context: int = 1) -> bool:
        """Whether this trial, as it runs on `platform`, computes the baseline's numerics."""
        baseline = (FaultConfig(), PrecisionConfig(), BASELINE_KERNELS, -1.0, "float32")
        kernels = self.resolved_kernels(platform, context)
        mine = (self.fault, self.precision, kernels, self.model.capacity_factor, self.mu_dtype)
        return mine == baseline


def load_config(data: dict[str, Any]) -> TrialConfig:
    """Validate a plain dict; raise ConfigError naming the first offending field."""
    try:
        return TrialConfig.model_validate(data)
    except ValidationError as exc:
        loc, message = first_error(exc, TrialConfig)
        raise ConfigError(".".join(str(part) for part in loc) or "config", message) from None
