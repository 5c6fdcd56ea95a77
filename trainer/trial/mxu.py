"""What the MXU does with a kernel's tiles, with no JAX: the share of the peak a program's
matmuls reach (fitted), the least time a Pallas kernel's grid step takes, how much of TPU7x's
MXU a held tile fills, and what a causal Splash kernel computes by its blocks. The step model
read from a compiled program (trainer/compile/step_model.py) and the analytic estimate
(trainer/estimate/analytic.py) share them.
"""

from __future__ import annotations

import math
from typing import Any

from trainer.trial.config import TrialConfig
from trainer.trial.hardware import Backend

# Fitted by benchmarks/calibration.py on the published llama3.1-70b 8k rows on 64 chips, one
# constant per row: the bf16 row fixes `MXU_EFFICIENCY`, the fp8 row `FP8_MXU_EFFICIENCY`
# (the share of each precision's peak its dots reach once the kernels' idle MXU cells are
# counted: Splash at head_dim 128 fills half of TPU7x's MXU, and runs in bf16 in fp8 programs
# too). Nothing else is fitted: what communication hides is the schedule's. Fitted on
# programs whose backward runs no second Splash forward (as MaxText's; 0.76/0.77 on programs
# that did) and whose loss runs its two gradient matmuls in turn (0.72/0.70 before).
# Refitted on the same two rows compiled by libtpu 0.0.52 (MaxText 0.2.5's compiler, ours
# since 2026-12-04), with no other change to the model before the held-out rows were
# compiled by it: 0.75/0.66 (0.72/0.71 on 0.0.42.1's programs). Held out: docs/trainer.md.
# Refitted again, 0.75/0.69, once the walk read 0.0.52's SparseCore collectives (async custom
# calls: before, the 70B bf16 row read 32 KB of collectives a step) after the held-out rows
# had been compared: their frozen predictions stand as made (benchmarks/calibration.py).
# Refitted, 0.77/0.72, once each kernel family ran at its own measured efficiency
# (KERNEL_MXU_EFFICIENCY, SPLASH_RESCALE_S): these two now price XLA's own matmuls and
# kernels of no measured family (2026-12-06; every compared row was seen before).
MXU_EFFICIENCY = 0.77
FP8_MXU_EFFICIENCY = 0.72
F32_MATMUL_SHARE = 0.25  # an f32 matmul runs as several bf16 passes on the MXU
# int8 products' share of the int8 peak, where measured: fitted on the lent v5e's six int8
# points of v5e_dense at batch 8 (fidelity run; their compile-fidelity predictions, frozen
# before, read them 9-15% fast at MXU_EFFICIENCY; docs/calibration.md, "TPU v5e"): the median
# of the efficiency each one's measured step asks of its counted int8 FLOPs, the rest of its
# step as the model prices it. Elsewhere int8 runs at MXU_EFFICIENCY (no int8 step measured).
INT8_MXU_EFFICIENCY: dict[str, float] = {"v5e": 0.59}
# Each Mosaic kernel family's own share of its precision's peak, on the chip (topology
# prefix) it was timed on, and for Splash the cost of each accumulator element it rescales:
# fitted by `python -m benchmarks.kernel_reference --fit` on tokamax 0.0.17's timings of its
# kernels alone on TPU7x (its autotuning data: fidelity run, TPU7x, tokamax's authors), each
# family to the least median |error| over its entries, the step model's FLOPs (the MXU share
# the blocks fill), grid steps and waits held. Splash pays its grid steps (GRID_STEP_S) on top
# of its work, and each block_kv_compute keys it touches its (block_q x head_dim) accumulator
# again (the online softmax's rescale; its dK/dV kernel's likewise): at 8k its 1024-wide
# blocks run 21% slower than 2048-wide though they compute 10% fewer scores, and 256-wide kv
# compute blocks 15% slower than 512-wide. So priced, the model orders 27 of tokamax's 36
# same-shape pairs as measured (at its FLOPs alone at one efficiency, 1). No timing has kv
# compute blocks above 1024: there the model extrapolates. Kernels of no family here
# (Megablox, libtpu's ragged_dot, ...) and chips with none run at the whole-step
# MXU_EFFICIENCY, their grid steps a floor. Only the fp8 grouped-matmul forward was timed (3
# entries): the fp8 gradients take their bf16 pass's efficiency times the forward's fp8/bf16
# ratio (an assumption).
SPLASH_FORWARD, SPLASH_RESIDUALS, SPLASH_BACKWARD = (
    "Splash forward", "Splash forward (residuals)", "Splash backward")  # fmt: skip
GMM_FORWARD, GMM_INPUT_GRADIENT, GMM_WEIGHT_GRADIENT = (
    "gmm forward", "gmm input gradient", "gmm weight gradient")  # fmt: skip
FP8 = ", fp8"  # a family's fp8 twin: fp8 weights, activations quantized in the kernel
KERNEL_MXU_EFFICIENCY: dict[str, dict[str, float]] = {
    "tpu7x": {
        SPLASH_FORWARD: 0.725,
        SPLASH_RESIDUALS: 0.65,
        SPLASH_BACKWARD: 0.745,
        GMM_FORWARD: 0.77,
        GMM_INPUT_GRADIENT: 0.72,
        GMM_WEIGHT_GRADIENT: 0.595,
        GMM_FORWARD + FP8: 0.57,
    }
}
SPLASH_RESCALE_S: dict[str, dict[str, float]] = {
    "tpu7x": {SPLASH_FORWARD: 3.6e-13, SPLASH_RESIDUALS: 2.2e-13, SPLASH_BACKWARD: 4.3e-13}
}
# tokamax's grouped matmul's kernels, by the name a compiled program gives each pass
_TOKAMAX_GMM = {"pallas_tpu_ragged_dot_tgmm": GMM_WEIGHT_GRADIENT,
                "pallas_tpu_ragged_dot_gmm_transpose_rhs": GMM_INPUT_GRADIENT,
                "pallas_tpu_ragged_dot_gmm": GMM_FORWARD}  # fmt: skip
# The least time a Pallas TPU kernel's grid step takes, however little it computes. Source:
# the JAX documentation's Pallas TPU matrix multiplication guide (docs/pallas/tpu/matmul.ipynb,
# its recorded outputs, TPU v5e): a bf16 8192^3 matmul in 128^3 blocks (262,144 grid steps)
# took 95.0 ms, 0.362 us a step, and 4096^3 (32,768 steps) 12.0 ms, 0.367 us a step, where a
# step's matmul needs 0.021 us at v5e's 197 TFLOP/s and its two 32 KiB blocks 0.080 us at 819
# GB/s. With 512x1024x1024 blocks (5.5 us of matmul a step) the same guide's kernel is within
# 1% of XLA's matmul: the step's cost hides under work that outlasts it. So a floor, not a
# toll: a call takes at least its grid steps times this. Splash, whose timings on TPU7x say
# otherwise (tokamax's: smaller blocks run slower though they compute less), pays it as a
# toll (SPLASH_RESCALE_S, above). No TPU7x figure is public: v5e's is carried over, an
# assumption. Not fitted.
GRID_STEP_S = 0.36e-6


def mxu_fill(width: int, contracted: int, columns: int) -> float:
    """The share of a `width` x `width` systolic MXU a matmul keeps busy: it holds a
    (`contracted` x `columns`) operand in the array, a whole number of width x width tiles
    (each dim padded up to the width), and streams the other operand's rows through. 1 where
    the width is not known (0). Only for Mosaic kernels, whose code fixes which operand the
    array holds (the right-hand one) and whose tiles set these dims: XLA's emitter lays out
    its own matmuls, and any of them with a dim under 256 is HBM-bound on TPU7x anyway."""
    if not width:
        return 1.0
    return math.prod(d / (math.ceil(d / width) * width) for d in (contracted, columns))


def splash_fills(
    config: TrialConfig, context: int, width: int, fused_dq: bool = True
) -> tuple[float, float, float]:
    """MXU fill of the Splash forward, dK/dV and dQ kernels: each kernel's matmuls at equal
    FLOPs, each holding its right-hand block. Forward: QK^T (head_dim x kv block) and PV (kv
    block x head_dim). dK/dV: QK^T and dP = dO V^T (head_dim x kv block), dV = P^T dO and
    dK = dS^T Q (q block x head_dim), and dQ = dS K (kv block x head_dim) when fused. dQ
    apart: QK^T, dP and dQ."""
    head = config.model.head_dim
    blocks = config.resolved_kernels(Backend.TPU, context).blocks(config.seq_len, config.seq_len)
    kv, kv_dkv, q_dkv = (blocks[k] for k in ("block_kv_compute", "block_kv_dkv_compute",
                                             "block_q_dkv"))  # fmt: skip

    def over(*fills: float) -> float:  # one fill for matmuls of equal FLOPs
        return len(fills) / sum(1 / f for f in fills)

    along_kv = mxu_fill(width, head, kv_dkv)  # head_dim x kv, kv x head_dim: the same share
    along_q = mxu_fill(width, q_dkv, head)
    dkv = (along_kv, along_kv, along_q, along_q, *((along_kv,) if fused_dq else ()))
    return mxu_fill(width, head, kv), over(*dkv), along_kv


def flops_per_score(config: TrialConfig, global_batch: int, num_devices: int) -> float:
    """FLOPs per device of one matmul of attention, per score element (query x key)."""
    return float(2 * global_batch * config.model.num_heads * config.model.head_dim / num_devices)


def splash_score_counts(config: TrialConfig, context: int) -> tuple[float, float]:
    """Score elements the causal Splash forward and backward kernels compute, by their
    blocks; with context parallelism (blocks of a sharded mask, not counted), the causal
    half."""
    s = config.seq_len
    if context != 1:
        return s * s / 2, s * s / 2
    blocks = config.resolved_kernels(Backend.TPU, context).blocks(s, s)
    return (
        splash_scores(s, blocks["block_q"], blocks["block_kv"]),
        splash_scores(s, blocks["block_q_dkv"], blocks["block_kv_dkv"]),
    )


def splash_scores(seq: int, block_q: int, block_kv: int) -> float:
    """Score elements a causal Splash kernel computes: it skips the (block_q, block_kv)
    blocks the mask covers whole and computes every other block in full, so a block on the
    diagonal costs as much as one under it (2048-row blocks at 8k: 1.25x the causal half)."""
    rows = seq // block_q
    per_row = (min(seq // block_kv, math.ceil((i + 1) * block_q / block_kv)) for i in range(rows))
    return sum(per_row) * block_q * block_kv


def splash_work(
    config: TrialConfig, global_batch: int, num_devices: int, context: int = 1, mxu_width: int = 0
) -> dict[str, float]:
    """Per device, for one layer, without a compiled program: the FLOPs the MXU spends on a
    Splash forward and on its backward (its blocks' causal work, over the MXU share they fill:
    trainer.compile.step_model.kernel_flops's formula) and the grid steps of each (its
    grid_steps' count)."""
    forward, backward = splash_score_counts(config, context)
    fill_fwd, fill_dkv, _ = splash_fills(config, context, mxu_width)
    per_score = flops_per_score(config, global_batch, num_devices)
    s = config.seq_len // context
    blocks = config.resolved_kernels(Backend.TPU, context).blocks(s, config.seq_len)
    sequences_heads = per_score / (2 * config.model.head_dim)
    return {
        "forward_flops": 2 * per_score * forward / fill_fwd,
        "backward_flops": 4 * per_score * backward / fill_dkv,
        "forward_steps": sequences_heads
        * math.ceil(s / blocks["block_q"])
        * math.ceil(config.seq_len / blocks["block_kv"]),
        "backward_steps": sequences_heads
        * math.ceil(s / blocks["block_q_dkv"])
        * math.ceil(config.seq_len / blocks["block_kv_dkv"]),
        # (block_q x head_dim) accumulator elements touched once per block_kv_compute keys
        "forward_rescaled": sequences_heads
        * forward
        * config.model.head_dim
        / blocks["block_kv_compute"],
        "backward_rescaled": sequences_heads
        * backward
        * config.model.head_dim
        / blocks["block_kv_dkv_compute"],
    }


def whole_tiles(
    rows: float, contracted: float, columns: float, tiles: tuple[int, int, int], groups: int
) -> int:
    """The (tm, tk, tn) tiles a grouped matmul of `rows` routed rows over `groups` experts
    computes (its grid steps): at most rows/tm + groups - 1 row tiles (a row tile two
    experts share runs once for each: the kernels' group metadata; routed rows rarely end on
    a tile edge), its contraction and columns padded to whole tiles."""
    tm, tk, tn = tiles
    row_tiles = math.ceil(rows / tm) + groups - 1
    return row_tiles * math.ceil(contracted / tk) * math.ceil(columns / tn)


def kernel_family(call: dict[str, Any]) -> str:
    """The family of a compiled program's kernel call whose efficiency may be measured
    (`KERNEL_MXU_EFFICIENCY`): tokamax's Splash (ours and MaxText's: splash_{mha,mqa}_{fwd,
    dkv,dq}...) by pass, tokamax's grouped matmul by pass and precision; "" for any other."""
    name = call["name"]
    if name.startswith("splash_"):
        if "_fwd" not in name:
            return SPLASH_BACKWARD
        residuals = name.endswith("_residuals") and not name.endswith("_no_residuals")
        return SPLASH_RESIDUALS if residuals else SPLASH_FORWARD
    family = next((f for k, f in _TOKAMAX_GMM.items() if name.startswith(k)), "")
    return family + FP8 if family and call.get("precision") == "fp8" else family


def rescale_seconds(prefix: str, call: dict[str, Any]) -> float | None:
    """What each accumulator element a Splash call rescales costs on the chip of topology
    prefix `prefix`, where measured there; None: its FLOPs and grid steps' floor alone."""
    return SPLASH_RESCALE_S.get(prefix, {}).get(kernel_family(call))


def kernel_efficiency(prefix: str, call: dict[str, Any]) -> float | None:
    """A kernel call's MXU efficiency on the chip of topology prefix `prefix` where its family
    was measured there (an fp8 gradient: its bf16 pass's times the forward's fp8/bf16
    ratio); None: the whole-step efficiency applies."""
    measured = KERNEL_MXU_EFFICIENCY.get(prefix, {})
    family = kernel_family(call)
    if family in measured:
        return measured[family]
    bf16 = family.removesuffix(FP8)
    if family.endswith(FP8) and bf16 in measured and GMM_FORWARD + FP8 in measured:
        return measured[bf16] * measured[GMM_FORWARD + FP8] / measured[GMM_FORWARD]
    return None
