"""Analytic step model: FLOPs, bytes, communication, memory and a step time built like the
step model a compile reads (trainer/compile/step_model.py), from formulas (fidelity: estimate).

Every figure here is an estimate from formulas and a datasheet; none is a measurement.
Compile trials reuse it with the compiler's real memory in place of the estimated one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from trainer.trial.capacity import receive_buffer_groups
from trainer.trial.checks import check_static, global_batch_size
from trainer.trial.config import GMM_PASSES, TrialConfig
from trainer.trial.flags import LAYER_SCHEDULER, flag_on
from trainer.trial.flops import training_flops_by_kind
from trainer.trial.hardware import Accelerator, Backend
from trainer.trial.mxu import (
    FP8_MXU_EFFICIENCY,
    GRID_STEP_S,
    MXU_EFFICIENCY,
    kernel_efficiency,
    mxu_fill,
    rescale_seconds,
    splash_work,
    whole_tiles,
)
from trainer.trial.remat import Tensor, placements
from trainer.trial.tokamax_tiles import HEURISTIC_VMEM_BYTES, heuristic_tiles, run_tiles

BF16, F32 = 2, 4


def parameter_count(config: TrialConfig) -> int:
    m = config.model
    attention = m.d_model * m.head_dim * (2 * m.num_heads + 2 * m.num_kv_heads)
    if m.is_moe:
        mlp = (
            m.num_experts * m.mlp_dim + m.shared_width
        ) * 3 * m.d_model + m.d_model * m.num_experts
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
    # What libtpu 0.0.52's compiles move (the search tables' programs, fidelity compile): FP8
    # weights gathered quantized, a byte each; gradients reduce-scattered in bf16; under FP8
    # the row-parallel matmuls' partial sums all-reduced in f32.
    fp8 = config.precision.mode == "fp8"
    partial = F32 if fp8 else BF16  # bytes of a row-parallel output's partial sum
    comm = {
        # weights all-gathered in forward and again in backward; gradients reduce-scattered
        "fsdp_all_gather": 2 * gathered * (1 if fp8 else BF16),
        "fsdp_reduce_scatter": gathered * BF16,
        "data_all_reduce": 2 * weights_local / shard * F32 * ring(degrees["data"]),
        # two activation all-reduces per layer forward, two backward (each 2x: a ring's)
        "tensor_all_reduce": 8 * m.num_layers * tokens_local * m.d_model * partial * ring(tensor),
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


# What the step holds at its peak beyond the parameters, optimizer state, gradients and saved
# activations: the larger of the loss's working set and one layer's backward. Their parts are
# what libtpu 0.0.52 reports live at its peak (XLA's live-range dump) on a 4-layer model at
# tensor 1 and 2, llama3.1-70b 8k and qwen3-235b-a22b 4k (docs/trainer.md); the four constants
# are fitted on every compile recorded by 2026-12-04 (`python -m benchmarks.memory_model --fit`):
# Bytes per layer parameter in its backward: its bf16 weights gathered, the next layer's
# prefetched and its weight gradient, in part.
LAYER_WEIGHT_BYTES: float = 3.46
# Copies of the layer's tensors (named and unnamed: trainer.trial.remat's and the norms'
# outputs and the gated activation) alive at the peak of its backward, its MLP's.
LAYER_ACTIVATION_COPIES: float = 1.62
# An MoE layer's routed rows of d_model (each token's top-k slots) alive at that peak: the
# dispatched input, the combine's operands and their gradients.
ROUTED_COPIES: float = 4.19
# FP8 with the MLP sharded over `tensor`: quantized copies of the MLP's up-projections kept
# beside the bf16 ones (at tensor 1 the compiles show none).
FP8_MLP_COPIES: float = 2.0
# What libtpu gives back when a device has no room for more (compiled told a device offers
# less: --xla_tpu_max_hbm_size_mib): an MoE layer's routed rows, of which its layers' loop
# then holds three buffers, not ROUTED_COPIES: deepseek-v3's MaxText recipe at its floor,
# qwen3-235b's offered 70 GiB (seven with 14 GiB free). The step's floor, `memory_per_device`.
ROUTED_FLOOR_COPIES: float = 3.0


def layer_tensor_bytes(
    config: TrialConfig, degrees: dict[str, int], tokens_local: float
) -> dict[str, float]:
    """Bytes per device of each tensor a decoder layer names (trainer.trial.remat.Tensor), for
    one layer: what saving it on device (or offloading it) costs per layer."""
    m, tensor = config.model, degrees["tensor"]
    heads = tokens_local * m.head_dim * BF16 / tensor
    residual = tokens_local * m.d_model * BF16
    sizes = {
        Tensor.DECODER_LAYER_INPUT: residual,
        Tensor.CONTEXT: heads * m.num_heads,
        Tensor.QUERY_PROJ: heads * m.num_heads,
        Tensor.KEY_PROJ: heads * m.num_kv_heads,
        Tensor.VALUE_PROJ: heads * m.num_kv_heads,
        Tensor.QKV_PROJ: heads * (m.num_heads + 2 * m.num_kv_heads) if m.fused_qkv else 0.0,
        Tensor.OUT_PROJ: residual,
    }
    rows = routed_rows(config, degrees, tokens_local) if m.is_moe else tokens_local
    sizes[Tensor.MLPWI_0] = sizes[Tensor.MLPWI_1] = rows * m.mlp_dim * BF16 / tensor
    # An expert's output row is a partial sum over the tensor shards of the mlp dimension
    # (summed after the combine): every device holds whole d_model rows.
    sizes[Tensor.MLPWO] = rows * m.d_model * BF16 / (1 if m.is_moe else tensor)
    if m.shared_width:  # the shared experts' MLP answers to the dense MLP's names
        shared = tokens_local * m.shared_width * BF16 / tensor
        sizes[Tensor.MLPWI_0] += shared
        sizes[Tensor.MLPWI_1] += shared
        sizes[Tensor.MLPWO] += residual / tensor
    return {t.value: v for t, v in sizes.items()}


def routed_rows(config: TrialConfig, degrees: dict[str, int], tokens_local: float) -> float:
    """An MoE layer's routed rows per device: each token's top-k slots, received into the
    expert-parallel buffer."""
    m = config.model
    slots = tokens_local * m.experts_per_token
    groups = receive_buffer_groups(
        round(slots), m.num_experts, degrees["expert"], m.capacity_factor
    )
    return slots * groups


def _placed(config: TrialConfig) -> dict[str, tuple[str, ...]]:
    """Tensor names kept on device and offloaded, each once (an MoE twin counts as its tensor;
    the layer input, the checkpoint boundary, is kept on device unless offloaded)."""
    placed = placements(config.remat)
    boundary = Tensor.DECODER_LAYER_INPUT.value
    out: dict[str, tuple[str, ...]] = {}
    for where in ("device", "offload"):
        names = {n.removeprefix("moe_") for n in placed[where]}
        out[where] = tuple(sorted(names))
    # The layer's input is its checkpoint's input, which the backward needs and no policy
    # recomputes: placed `remat`, it stays on device (compiled for TPU7x, 2026-12-07: our
    # trainer's 8 layers 2.777 GiB a device placed `device` or `remat`, 2.556 offloaded;
    # MaxText's deepseek-v3 recipe with it `remat` needs 112.75 GiB where offloaded 89.39).
    if boundary not in out["offload"]:
        out["device"] = tuple(sorted({boundary, *out["device"]}))
    # A dense MLP's output is read only by the residual add whose result is the next layer's
    # input: kept beside that input it holds nothing the backward reads (XLA drops it; the
    # 405B recipe's offloaded mlpwo moved no bytes to host). An MoE layer's is read: the
    # router weights' gradient takes each expert's output (mixtral-8x7b, TP 4, kept on device:
    # 109.6 GiB of temporaries where 89.9 were estimated without it).
    if not config.model.is_moe and boundary in (*out["device"], *out["offload"]):
        out = {k: tuple(n for n in v if n != Tensor.MLPWO.value) for k, v in out.items()}
    return out


def memory_per_device(
    config: TrialConfig, degrees: dict[str, int], global_batch: int, grad_bytes: int = F32
) -> dict[str, float]:
    """Bytes per device at the step's peak: parameters, optimizer state and gradients (at
    `grad_bytes` each: MaxText keeps them in its `grad_dtype`, our trainer in float32); the
    activations each layer keeps on device for the backward (per tensor, as the remat policy
    or its custom placements place them; offloaded ones are host bytes); and the working set
    of one layer's backward or of the loss, whichever is larger. `total` is what the step
    takes with room (the constants are fitted on such compiles); `floor`, what it compiles
    in where the device has no more (ROUTED_FLOOR_COPIES), the figure a fit is judged by."""
    m = config.model
    shards = degrees["fsdp"] * degrees["context"] * degrees["expert"] * degrees["tensor"]
    params = parameter_count(config) / shards
    tokens_local = (
        global_batch
        * config.seq_len
        / (degrees["data"] * degrees["fsdp"] * degrees["expert"] * degrees["context"])
    )
    sizes = layer_tensor_bytes(config, degrees, tokens_local)
    placed = _placed(config)
    saved = m.num_layers * sum(sizes[n] for n in placed["device"])
    host = m.num_layers * sum(sizes[n] for n in placed["offload"])
    # One layer's backward (the constants above): its weights gathered over fsdp (a device's
    # own experts only), its tensors, an MoE layer's routed rows, fp8's quantized copies.
    experts = expert_parameter_count(config) / m.num_layers
    layer_params = (
        (parameter_count(config) - 2 * m.vocab_size * m.d_model) / m.num_layers - experts
    ) / degrees["tensor"] + experts / (degrees["tensor"] * degrees["expert"])
    residual = tokens_local * m.d_model * BF16
    unnamed = 2 * residual + sizes[Tensor.MLPWI_0.value]
    if m.is_moe:
        unnamed += sizes[Tensor.MLPWO.value]  # routed rows x d_model, as the MLP's output
    routed = sizes[Tensor.MLPWO.value] if m.is_moe else 0.0
    fp8 = config.precision.mode == "fp8" and degrees["tensor"] > 1
    # The loss: the bf16 logits (one tile when tiled) and, where the vocabulary is not sharded
    # over `tensor`, their gradient (sharded, libtpu fuses it into the gradient matmuls); the
    # gathered bf16 unembedding twice (the forward's and the gradient matmul's copy); the
    # final norm's output and its gradient.
    vocab_whole = degrees["tensor"] == 1
    # The logits are kept beside the layers' backward where the vocabulary is whole, unless
    # libtpu's layer scheduler runs the unembedding's weight gradient first (flags.py).
    logits_beside = vocab_whole and not flag_on(config.xla.libtpu_init_args(), LAYER_SCHEDULER)
    logits = tokens_local * m.vocab_size / degrees["tensor"] * BF16 / config.vocab_tiling
    unembedding = m.vocab_size * m.d_model / degrees["tensor"] * BF16
    loss = logits * (2 if vocab_whole else 1) + 2 * unembedding + 2 * residual
    layer = (
        LAYER_WEIGHT_BYTES * layer_params
        + LAYER_ACTIVATION_COPIES * (sum(sizes.values()) + unnamed)
        + ROUTED_COPIES * routed
        + FP8_MLP_COPIES * sizes[Tensor.MLPWI_0.value] * fp8
        # the logits, kept until the unembedding's weight gradient, which libtpu runs beside
        # the layers' backward when the vocabulary is whole (qwen3's 18.5 GiB stay live there)
        # and its layer scheduler is off
        + logits * logits_beside
    )
    working = max(layer, loss)
    pressed = max(layer - max(ROUTED_COPIES - ROUTED_FLOOR_COPIES, 0.0) * routed, loss)
    mu_bytes = BF16 if config.mu_dtype == "bfloat16" else F32
    memory = {
        "params_f32": params * F32,
        "optimizer_state": params * (mu_bytes + F32),
        "gradients": params * grad_bytes,
        "activations": saved,
        "working_set": working,
    }
    memory["total"] = sum(memory.values())
    memory["floor"] = memory["total"] - working + pressed
    memory["host_activations"] = host  # pinned host memory, not in the device total
    return memory


def recomputed(config: TrialConfig) -> dict[str, bool]:
    """Which of a layer's forward matmuls the backward runs again: those whose outputs the
    remat policy (or its custom placements) neither keeps nor offloads. A dense MLP's output
    projection never is: the backward reads its input, not its output (the compiles: full
    remat runs the layers' matmuls 1.24x, not 4/3x, on search_table's model). Saving the
    context spares the attention core."""
    kept = {n.removeprefix("moe_") for where in placements(config.remat).values() for n in where}
    qkv = {Tensor.QUERY_PROJ.value, Tensor.KEY_PROJ.value, Tensor.VALUE_PROJ.value}
    wi = not {Tensor.MLPWI_0.value, Tensor.MLPWI_1.value} <= kept
    return {
        "qkv": not (qkv <= kept or Tensor.QKV_PROJ.value in kept),
        "attention": Tensor.CONTEXT.value not in kept,
        "out": Tensor.OUT_PROJ.value not in kept,
        "wi": wi,
        # an MoE layer's expert outputs feed the router weights' gradient (see _placed)
        "wo": config.model.is_moe and Tensor.MLPWO.value not in kept,
        # the shared experts' MLP, as a dense one (its tensors answer to the same names)
        "shared_wi": wi,
        "shared_wo": False,
    }


def forward_flops_per_token(config: TrialConfig) -> dict[str, float]:
    """A layer's forward FLOPs per token, by matmul (causal attention: half of 4 x seq)."""
    m = config.model
    experts = m.experts_per_token if m.is_moe else 1
    return {
        "qkv": 2 * m.d_model * m.head_dim * (m.num_heads + 2 * m.num_kv_heads),
        "attention": 2 * config.seq_len * m.num_heads * m.head_dim,
        "out": 2 * m.num_heads * m.head_dim * m.d_model,
        "wi": 4 * m.d_model * m.mlp_dim * experts,
        "wo": 2 * m.d_model * m.mlp_dim * experts,
        "shared_wi": 4 * m.d_model * m.shared_width,
        "shared_wo": 2 * m.d_model * m.shared_width,
    }


def recompute_share(config: TrialConfig) -> float:
    """Share of a layer's forward FLOPs the backward recomputes (`recomputed`)."""
    flops, again = forward_flops_per_token(config), recomputed(config)
    return sum(f for k, f in flops.items() if again[k]) / sum(flops.values())


def expert_tiles(
    config: TrialConfig,
    degrees: dict[str, int],
    rows: float,
    mxu_width: int = 0,
    slowdown: dict[str, float] | None = None,
    again: dict[str, bool] | None = None,
    tokamax_vmem: int | None = None,
) -> tuple[float, float]:
    """(The MXU work of an MoE layer's expert matmuls over their FLOPs; the tiles, the
    kernels' grid steps, of one layer's forward and backward), as the grouped-matmul
    kernels compute them (`trainer.compile.step_model.grouped_matmul_flops` reads the same
    from a compiled program): whole (tm, tk, tn) tiles over at most rows/tm + G - 1 row tiles
    (a tile two experts share runs for each), the other dims padded to whole tiles, over the
    MXU share the held tile fills (`mxu_width`, the chip's; 0: not counted). `rows`: routed
    rows per device. Tiles: Megablox's `gmm_tm/tk/tn`; tokamax's as this host's tokamax runs
    them (`run_tiles`: the knob's, MaxText's defaults where tokamax has no tables, else its
    own: its table's entry or 128 x 128 x 128); 1 for XLA's ragged_dot (libtpu's lowering
    states its tiles only in a compiled program).
    `slowdown`: per pass, the layers' MXU efficiency over the pass's kernel's own
    (`_kernel_slowdowns`; none: 1). `again`: per weight, whether the policy recomputes its
    forward (`recomputed`), whose grid steps then run twice. `tokamax_vmem`: the chip's VMEM
    where tokamax picks its own tiles for bf16 operands (MaxText's program on TPU7x:
    `heuristic_tiles`; its tile knobs inert there); None: `run_tiles`."""
    m = config.model
    kernels = config.resolved_kernels(Backend.TPU, degrees["context"])
    if not m.is_moe or kernels.moe_gmm not in ("megablox", "tokamax") or rows < 1:
        return 1.0, 0.0
    groups = m.num_experts // degrees["expert"]
    d, mlp = m.d_model, m.mlp_dim // degrees["tensor"]
    shapes = {  # weight: {pass: (rows, contracted, columns)}, the kernel's order; wi runs twice
        "wi": {"fwd": (rows, d, mlp), "dlhs": (rows, mlp, d), "drhs": (rows, d, mlp)},
        "wo": {"fwd": (rows, mlp, d), "dlhs": (rows, d, mlp), "drhs": (rows, mlp, d)},
    }
    computed = useful = steps = 0.0
    for weight, passes in shapes.items():
        dims = {p: (round(r), round(k), round(n)) for p, (r, k, n) in passes.items()}
        if kernels.moe_gmm == "tokamax" and tokamax_vmem and config.precision.mode == "bf16":
            tiles = heuristic_tiles(dims["fwd"], tokamax_vmem)
        elif kernels.moe_gmm == "tokamax":  # as this host's tokamax builds the kernel
            fp8 = config.fp8_experts_in_tokamax(Backend.TPU)
            tiles = run_tiles(dims["fwd"], groups, weight, kernels.tokamax_tiles, fp8)
        else:
            tiles = {p: (kernels.gmm_tm, kernels.gmm_tk, kernels.gmm_tn) for p in GMM_PASSES}
        for name in GMM_PASSES:
            r, k, n = passes[name]
            tm, tk, tn = tiles[name] or (1, 1, 1)
            held = (tm, tn) if name == "drhs" else (tk, tn)
            count = whole_tiles(r, k, n, (tm, tk, tn), groups)
            times = 2 if weight == "wi" else 1
            slower = (slowdown or {}).get(name, 1.0)
            computed += times * count * tm * tk * tn / mxu_fill(mxu_width, *held) * slower
            useful += times * r * k * n
            steps += times * count * (1 + (again or {}).get(weight, False) * (name == "fwd"))
    return computed / useful, steps


def expert_waits(config: TrialConfig, degrees: dict[str, int], again: dict[str, bool]) -> float:
    """HBM bytes an MoE layer's grouped matmuls wait on, per device (the step model's
    `grouped_matmul_waits`, without the tiles' padding): each expert's weights once a forward,
    recompute and input-gradient pass, its weight gradient (2 bytes) once; wi twice (gate and
    up). 0 for a dense layer or XLA's ragged_dot."""
    m = config.model
    kernels = config.resolved_kernels(Backend.TPU, degrees["context"])
    if not m.is_moe or kernels.moe_gmm not in ("megablox", "tokamax"):
        return 0.0
    weights = m.num_experts // degrees["expert"] * m.d_model * m.mlp_dim // degrees["tensor"]
    width = 1 if config.precision.mode == "fp8" else 2
    passes = {"wi": 2, "wo": 1}  # weights of each kind, each a grouped matmul
    return sum(count * weights * ((2 + again[w]) * width + 2) for w, count in passes.items())


# The screen's step (`estimate`): the TensorCore's work in turn, with communication hidden
# under it but for what the structure exposes. Each constant multiplies a term named by it;
# fitted by `python -m benchmarks.step_estimate --fit` (non-negative least squares) on the
# step model's figures for every point of the three compiled search tables (fidelity compile,
# libtpu 0.0.52; benchmarks/data/search_table*.csv), 2026-12-04:
# Fitted on the lent v5e (ACCELERATOR_CONSTANTS, below), 2026-12-06.
SCORE_PASSES = 5.69
V5E_MXU, V5E_INT8_MXU, V5E_FP8_MXU = 0.837, 0.935, 0.971
V5E_LAYER_PASSES, V5E_SAVED_PASSES = 0.817, 5.012
V5E_ROUTING = 7.574
STEP_CONSTANTS: dict[str, float] = {
    # Splash grid steps at GRID_STEP_S (trainer.trial.mxu, the step model's too): the
    # share not hidden under the kernels' own work.
    "grid_steps": 0.615,
    # Passes of non-matmul ops (norms, rotary embedding, gating, residual adds, casts) over a
    # layer's tensors, per layer pass (forward, recompute, backward).
    "layer_passes": 4.039,
    # Passes over the f32 logits (softmax, its gradient, the casts).
    "loss_passes": 2.735,
    # Passes over the saved activations (written in the forward, read in the backward, and
    # the scan's stacking of them).
    "saved_passes": 8.153,
    # FP8: quantizing the layers' matmul inputs (scales, casts), as passes over their tensors.
    "fp8_passes": 2.51,
    # MoE routing's gathers and combines (`routing_bytes`), as passes over their bytes at the
    # rate of the engine that runs them (TPU7x's SparseCores; HBM on a chip without): not
    # fitted on TPU7x (1); ACCELERATOR_CONSTANTS["v5e"] holds the lent v5e's.
    "routing": 1.0,
    # The first layer's weights gathered and the last reduce-scatter: nothing to hide under.
    "edge_gathers": 1.638,
    # FP8 with the model sharded over `tensor`: the share of the row-parallel outputs'
    # all-reduces that stalls the TensorCore (their partial sums are f32).
    "fp8_tensor_all_reduce": 0.2,
    # The XLA reference attention's float32 scores (batch x heads x seq^2 per layer), as
    # passes over them through HBM in a step (written, softmaxed, read back, and again in the
    # backward): none of the tables above has XLA attention, so this one is fitted with
    # ACCELERATOR_CONSTANTS["v5e"] on the lent v5e's measurements (see there). A property of
    # XLA's program, not of the chip: every accelerator's estimate takes it.
    "score_passes": SCORE_PASSES,
}

# Constants of one accelerator, where its own measurements refit them: the whole step's MXU
# efficiency of bf16 matmuls (`mxu_efficiency`, in place of MXU_EFFICIENCY), int8's share of
# its own peak (`int8_mxu_efficiency`; without it, the bf16 efficiency), and STEP_CONSTANTS
# terms. v5e: fitted by `python -m benchmarks.v5e_predictions fit v5e_dense` (least squares
# of log tokens/s) on the lent chip's 18 points of v5e_dense at batch 8 (fidelity run,
# benchmarks/data/v5e_dense_grid.csv), its 18 at batch 16 held out (docs/calibration.md,
# "TPU v5e"); the frozen estimate had read every Splash point 21-37% slow there, its XLA
# attention within 8%, and int8 as bf16. Its `routing`: fitted by `... fit v5e_moe` (run
# with the chip's tokamax 0.0.12) on v5e_moe's 12 points at full remat, its 12 at minimal
# remat held out: v5e has no SparseCores, and its TensorCore moves the routing's rows at
# some 1/7.6 of HBM's rate (the frozen estimate read every Megablox and ragged_dot point
# 27-45% fast). TPU7x's constants are as they were.
ACCELERATOR_CONSTANTS: dict[str, dict[str, float]] = {
    "v5e": {
        "mxu_efficiency": V5E_MXU,
        "int8_mxu_efficiency": V5E_INT8_MXU,
        "fp8_mxu_efficiency": V5E_FP8_MXU,
        "layer_passes": V5E_LAYER_PASSES,
        "saved_passes": V5E_SAVED_PASSES,
        "routing": V5E_ROUTING,
    }
}


def constants_of(accel: Accelerator) -> dict[str, float]:
    """STEP_CONSTANTS with `accel`'s own where it has them."""
    own = ACCELERATOR_CONSTANTS.get(accel.topology_prefix, {})
    return {**STEP_CONSTANTS, **{k: v for k, v in own.items() if k in STEP_CONSTANTS}}


def step_terms(
    config: TrialConfig, accel: Accelerator, num_devices: int, global_batch: int
) -> dict[str, float]:
    """Seconds of each term of the screen's step on one device, each at a constant of 1
    (`STEP_CONSTANTS` weighs them; `compute` and `update` are not fitted)."""
    degrees = check_static(config, num_devices)
    mem = memory_per_device(config, degrees, global_batch)
    comm = communication_bytes_per_device(config, degrees, global_batch)
    return _terms(config, accel, num_devices, global_batch, degrees, mem, comm)


def _terms(
    config: TrialConfig,
    accel: Accelerator,
    num_devices: int,
    global_batch: int,
    degrees: dict[str, int],
    mem: dict[str, float],
    comm: dict[str, float],
    maxtext: bool = False,
) -> dict[str, float]:
    m = config.model
    peak, fp8_peak = accel.peak_flops_per_device("bf16"), accel.peak_flops_per_device("fp8")
    own = ACCELERATOR_CONSTANTS.get(accel.topology_prefix, {})
    mxu = own.get("mxu_efficiency", MXU_EFFICIENCY)
    hbm, ici = accel.hbm_bytes_per_s_per_device, accel.ici_axis_bytes_per_s_per_device
    tokens = global_batch * config.seq_len
    again = recomputed(config)
    per_token = forward_flops_per_token(config)
    tokens_local = tokens / (degrees["data"] * degrees["fsdp"] * degrees["expert"] * degrees[
        "context"])  # fmt: skip
    # the expert matmuls in whole tiles (a dense MLP: 1)
    rows = routed_rows(config, degrees, tokens_local) if m.is_moe else 0.0
    fp8 = config.precision.mode == "fp8"
    int8 = config.precision.mode == "int8"
    slowdown, splash_fwd, splash_bwd = _kernel_slowdowns(config, accel, degrees["context"], mxu)
    # MaxText 0.2.5's unquantized tokamax path passes no tiles: tokamax picks its own on TPU7x
    vmem = HEURISTIC_VMEM_BYTES.get(accel.topology_prefix) if maxtext else None
    waste, expert_steps = expert_tiles(config, degrees, rows, accel.mxu_width, slowdown, again,
                                       vmem)  # fmt: skip
    matmuls = {k: f * (3 + again[k]) for k, f in per_token.items() if k != "attention"}
    experts = (matmuls["wi"] + matmuls["wo"]) * waste if m.is_moe else 0.0
    dense = sum(matmuls.values()) - (matmuls["wi"] + matmuls["wo"] if m.is_moe else 0.0)
    layer = tokens * m.num_layers * dense / num_devices
    expert = tokens * m.num_layers * experts / num_devices
    logits = 3 * 2 * tokens * m.d_model * m.vocab_size / num_devices
    context = degrees["context"]
    forward, backward, grid, rescales = _attention_work(config, accel, num_devices, global_batch,
                                                        context, again)  # fmt: skip
    layer_rate = peak * mxu
    if fp8:
        layer_rate = fp8_peak * own.get("fp8_mxu_efficiency", FP8_MXU_EFFICIENCY)
    elif int8:  # the decoder's dots at the integer peak (the logits stay bf16, as qwix leaves them)
        layer_rate = accel.peak_flops_per_device("int8") * own.get("int8_mxu_efficiency", mxu)
    # the grouped-matmul kernels take at least their grid steps (the step model's floor)
    expert_s = max(expert / layer_rate, m.num_layers * expert_steps * GRID_STEP_S)
    expert_s += m.num_layers * expert_waits(config, degrees, again) / hbm
    attention_s = forward / (peak * splash_fwd) + backward / (peak * splash_bwd) + rescales
    compute = layer / layer_rate + expert_s + logits / (peak * mxu) + attention_s
    layer_bytes = m.num_layers * sum(layer_tensor_bytes(config, degrees, tokens_local).values())
    passes = 2 + sum(again[k] for k in ("qkv", "out", "wi")) / 3
    update = 2 * (mem["params_f32"] + mem["optimizer_state"] + mem["gradients"]) / hbm
    shard = degrees["fsdp"] * context * degrees["expert"]
    layer_params = (parameter_count(config) - 2 * m.vocab_size * m.d_model) / m.num_layers
    edge = (
        (layer_params + m.vocab_size * m.d_model) / degrees["tensor"] * BF16 * (shard - 1) / shard
    ) / ici
    return {
        "compute": compute,
        "update": update,
        "routing": routing_bytes(config, again, rows) / accel.sparsecore_bytes_per_s_per_device,
        "grid_steps": grid * GRID_STEP_S,
        "layer_passes": passes * layer_bytes / hbm,
        "loss_passes": tokens_local * m.vocab_size / degrees["tensor"] * F32 / hbm,
        # offloaded ones pass through HBM on their way to the host and back
        "saved_passes": (mem["activations"] + mem["host_activations"]) / hbm,
        # the layers' matmul inputs quantized (scales, casts): fp8's and int8's alike
        "fp8_passes": passes * layer_bytes / hbm * (fp8 or int8),
        "score_passes": _score_bytes(config, global_batch, num_devices, context) / hbm,
        "edge_gathers": edge,  # 0 unsharded: (shard - 1) / shard
        "fp8_tensor_all_reduce": comm["tensor_all_reduce"] / ici * fp8,
    }


def _score_bytes(config: TrialConfig, global_batch: int, num_devices: int, context: int) -> float:
    """The XLA reference attention's float32 scores of every layer, per device (0 with
    Splash, which keeps its blocks of them in VMEM)."""
    if config.resolved_kernels(Backend.TPU, context).attention == "splash":
        return 0.0
    m = config.model
    per_layer = global_batch * m.num_heads * config.seq_len * (config.seq_len / context) * F32
    return m.num_layers * per_layer / num_devices


def _attention_work(
    config: TrialConfig,
    accel: Accelerator,
    num_devices: int,
    global_batch: int,
    context: int,
    again: dict[str, bool],
) -> tuple[float, float, float, float]:
    """Attention's FLOPs per device a step, forward (again where the policy recomputes it) and
    backward, its kernel's grid steps, and the seconds Splash spends rescaling its
    accumulators where measured on `accel` (trainer.trial.mxu's `rescale_seconds`, as the step
    model prices a compiled program's calls; training's forward saves residuals): Splash by
    its blocks, or the XLA reference's causal half."""
    m = config.model
    runs = 2 if again["attention"] else 1
    if config.resolved_kernels(Backend.TPU, context).attention != "splash":
        tokens = global_batch * config.seq_len
        forward = tokens * m.num_layers * forward_flops_per_token(config)["attention"] / num_devices
        return forward * runs, 2 * forward, 0.0, 0.0
    splash = splash_work(config, global_batch, num_devices, context, accel.mxu_width)
    steps = m.num_layers * (runs * splash["forward_steps"] + splash["backward_steps"])
    prefix = accel.topology_prefix
    forward_s = rescale_seconds(prefix, {"name": "splash_mha_fwd_residuals"})
    backward_s = rescale_seconds(prefix, {"name": "splash_mha_dkv_no_residuals"})
    rescales = (
        m.num_layers * (runs * splash["forward_rescaled"] * forward_s
                        + splash["backward_rescaled"] * backward_s)
        if forward_s is not None and backward_s is not None else 0.0
    )  # fmt: skip
    return (m.num_layers * runs * splash["forward_flops"],
            m.num_layers * splash["backward_flops"], steps, rescales)  # fmt: skip


def _kernel_slowdowns(
    config: TrialConfig, accel: Accelerator, context: int, mxu: float = MXU_EFFICIENCY
) -> tuple[dict[str, float], float, float]:
    """The kernels' own MXU efficiencies where measured on `accel` (trainer.trial.mxu's
    `kernel_efficiency`, as the step model prices a compiled program's calls): per
    grouped-matmul pass, the layers' efficiency over its kernel's (tokamax's kernels); the
    Splash forward's (training's, which saves residuals) and backward's efficiency (the
    whole step's where not measured or not Splash)."""
    kernels = config.resolved_kernels(Backend.TPU, context)
    fp8 = config.precision.mode == "fp8"
    prefix, layers = accel.topology_prefix, FP8_MXU_EFFICIENCY if fp8 else mxu
    slowdown = {}
    if kernels.moe_gmm == "tokamax":
        names = {"fwd": "gmm", "dlhs": "gmm_transpose_rhs", "drhs": "tgmm"}
        for name, kernel in names.items():
            call = {"name": f"pallas_tpu_ragged_dot_{kernel}", "precision": config.precision.mode}
            slowdown[name] = layers / (kernel_efficiency(prefix, call) or layers)
    splash = kernels.attention == "splash"
    forward = kernel_efficiency(prefix, {"name": "splash_mha_fwd_residuals"}) if splash else None
    backward = (
        kernel_efficiency(prefix, {"name": "splash_mha_dkv_no_residuals"}) if splash else None
    )
    return slowdown, forward or mxu, backward or mxu


def routing_bytes(config: TrialConfig, again: dict[str, bool], rows: float) -> float:
    """HBM bytes an MoE step's routing moves per device: each layer gathers its tokens' rows
    into the routed order (`rows` of them, bf16 in fp8 programs too) and back (the combine),
    in the forward, again in the backward, and again where the policy recomputes the experts'
    input or output; each gather reads the rows it fetches and writes them (the compiled
    qwen3 recipe: 6 gathers of 4 GiB a layer, 4,514 GiB a step, as here)."""
    m = config.model
    if not m.is_moe:
        return 0.0
    gathers = 4 + again["wi"] + again["wo"]
    return m.num_layers * gathers * rows * m.d_model * BF16 * 2


@dataclass(frozen=True)
class _Step:
    """The step's terms weighed, and how they add up."""

    weighed: dict[str, float]
    busy: float  # the TensorCore's work in turn
    exposed: float  # communication the structure exposes
    routing: float  # MoE routing on the SparseCores, beside the TensorCore
    times: dict[str, float]  # seconds of each resource's work
    seconds: float  # the step


def _step(
    terms: dict[str, float], accel: Accelerator, mem: dict[str, float], comm: dict[str, float]
) -> _Step:
    constants = constants_of(accel)
    weighed = {k: v * constants.get(k, 1.0) for k, v in terms.items()}
    exposed_terms = ("edge_gathers", "fp8_tensor_all_reduce")
    busy = sum(v for k, v in weighed.items() if k not in (*exposed_terms, "routing"))
    exposed = sum(weighed[k] for k in exposed_terms)
    # MoE routing runs on the SparseCores, beside the TensorCore; the expert matmuls wait
    # for its rows
    routing = weighed["routing"]
    hbm_s = busy - weighed["compute"] - weighed["grid_steps"]
    ici_bytes_per_chip = accel.devices_per_chip * comm["total"]
    times = {
        "compute": weighed["compute"] + weighed["grid_steps"],
        "hbm": hbm_s,
        "ici": ici_bytes_per_chip / accel.ici_axis_bytes_per_s,  # a ring over one torus axis
        # offloaded activations go to the host in the forward and come back in the backward
        "host": accel.devices_per_chip * 2 * mem["host_activations"] / accel.host_link_bytes_per_s,
    }
    seconds = max(busy, times["ici"], times["host"]) + exposed + routing
    return _Step(weighed, busy, exposed, routing, times, seconds)


def _intensities(
    accel: Accelerator,
    precision: str,
    flops_per_chip: float,
    step: _Step,
    comm: dict[str, float],
) -> dict[str, float]:
    """FLOPs per byte the step moves over ICI and HBM, beside the hardware's. Per byte over
    each of the ring's two links, as the hardware figure is per link; the hardware's figure
    at the rate the estimate computes (the MXU efficiencies, Splash's blocks, the grid steps)
    rather than the peak: below it exactly when the ICI time exceeds the compute time."""
    peak = accel.peak_of(precision) * 1e12
    achieved = flops_per_chip / step.times["compute"] / peak  # the share of the peak computed at
    hbm_bytes_per_chip = step.times["hbm"] * accel.hbm_bytes_per_s
    ici_bytes_per_chip = accel.devices_per_chip * comm["total"]
    return {
        "arithmetic_intensity_ici": flops_per_chip / (ici_bytes_per_chip / 2)
        if ici_bytes_per_chip
        else float("inf"),
        "hardware_intensity_ici": accel.intensity_flops_per_ici_byte(precision) * achieved,
        "arithmetic_intensity_hbm": flops_per_chip / hbm_bytes_per_chip
        if hbm_bytes_per_chip
        else float("inf"),
        "hardware_intensity_hbm": accel.intensity_flops_per_hbm_byte(precision) * achieved,
    }


def estimate(
    config: TrialConfig,
    accel: Accelerator,
    num_devices: int,
    memory_bytes: float | None = None,
    maxtext: bool = False,
    grad_bytes: int = F32,
) -> dict[str, Any]:
    """Step estimate on `num_devices` devices of `accel` (fidelity: estimate).

    The TensorCore's work runs in turn (`step_terms`, weighed by `STEP_CONSTANTS`): the
    matmuls at the step model's MXU efficiencies (in FP8 the layers' projections and FFN at
    the FP8 peak; Splash's attention, by its blocks, and the logits at bf16), Splash's grid
    steps, non-matmul HBM traffic and the optimizer's update. Communication and host
    transfers run beside it; what the structure exposes (the first gather and last
    reduce-scatter of the layer loop; fp8's tensor-parallel all-reduces) adds to the step, and
    either stream longer than the TensorCore's work sets the step instead.

    `maxtext`: the trial is MaxText's program of the config's shape and settings, which
    differs from our trainer's where MaxText builds a kernel otherwise (its unquantized
    tokamax grouped matmul with tokamax's own tiles on TPU7x: `expert_tiles`); `grad_bytes`:
    what it keeps each gradient in (`memory_per_device`).
    """
    degrees = check_static(config, num_devices)
    global_batch = global_batch_size(config, num_devices)
    chips = num_devices / accel.devices_per_chip
    kinds = training_flops_by_kind(config.model, global_batch, config.seq_len)
    model_flops = sum(kinds.values())
    share = recompute_share(config)
    recompute = (kinds["layer_matmul"] + kinds["attention"]) / 3 * share
    precision = config.precision.peak
    peak = accel.peak_of(precision) * 1e12
    mem = memory_per_device(config, degrees, global_batch, grad_bytes)
    comm = communication_bytes_per_device(config, degrees, global_batch)
    step = _step(_terms(config, accel, num_devices, global_batch, degrees, mem, comm, maxtext),
                 accel, mem, comm)  # fmt: skip
    times = step.times
    tokens = global_batch * config.seq_len
    used = memory_bytes if memory_bytes is not None else mem["floor"]
    return {
        "fidelity": "estimate",
        "hardware": accel.name,
        "chips": chips,
        "model_flops_per_step": model_flops,
        "est_serial_s": step.exposed + step.routing + step.weighed["update"],
        "recompute_flops_per_step": recompute,
        "est_step_time_s": step.seconds,
        "est_compute_s": times["compute"],
        "est_hbm_s": times["hbm"],
        "est_ici_s": times["ici"],
        "est_busy_s": step.busy,
        "est_exposed_comm_s": step.exposed,
        "est_routing_s": step.routing,
        "bound": max(times, key=lambda name: times[name]),
        "est_tokens_per_sec_per_chip": tokens / step.seconds / chips,
        "est_mfu": model_flops / chips / step.seconds / peak,
        **_intensities(accel, precision, (model_flops + recompute) / chips, step, comm),
        "communication_bytes_per_device": comm,
        "est_memory_per_device": mem,
        "est_host_s": times["host"],
        "fits": used <= accel.usable_hbm_per_device
        and (  # 0: the host's memory is not known for this accelerator, not judged
            not accel.host_offload_per_device
            or mem["host_activations"] <= accel.host_offload_per_device
        ),
        "usable_hbm_per_device": accel.usable_hbm_per_device,
    }
