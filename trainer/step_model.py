"""Step time from the compiled program: its counted work (trainer/hlo_cost.py) over the
chip's datasheet rates, with explicit overlap rules (fidelity: estimate, from a compile).

- compute: matrix FLOPs by precision over the peak of that precision, at `MXU_EFFICIENCY`
  (bf16, f32) or `FP8_MXU_EFFICIENCY` (fp8 dots); Mosaic kernels (the HLO cannot look
  into them) add the FLOPs their tiles compute: Splash attention its blocks (their sizes
  decide how much of the causal mask's diagonal it computes in vain), a grouped matmul its
  whole row tiles, one more per expert boundary inside a tile (trainer/mosaic.py reads
  each call's tiles from the compiled program).
- HBM: bytes the top-level ops read and write, VMEM-resident values excluded; a slice of a
  stacked (scanned) buffer costs the slice.
- ICI: bytes each collective moves per device, ring-corrected by its group size, over the
  device's share of the chip's bidirectional ICI bandwidth on one torus axis, times the
  torus dimensions its rings use at once (libtpu's backend config: 3 where colors rotate
  over X, Y and Z, 1 for a single ring).
- host: bytes moved to or from pinned host memory (offload), over the host link.
- overlap: ops run one at a time; a matmul op's HBM traffic hides under its compute (the
  larger counts), an op without matmuls (elementwise, reductions, copies) adds its HBM
  time; a synchronous collective adds its time; SparseCore-offloaded and asynchronous
  collectives and host transfers run beside the TensorCore and hide behind `OVERLAP` of
  that busy time; the rest is exposed.
"""

from __future__ import annotations

import math
from typing import Any

from trainer.hardware import Accelerator

# Fitted by benchmarks/calibration.py on the published llama3.1-70b 8k rows on 64 chips, one
# constant per row: the bf16 row fixes `MXU_EFFICIENCY`, the fp8 row `FP8_MXU_EFFICIENCY`
# (fp8 dots reach a smaller share of their peak than bf16 ones: published fp8 is 1.46x bf16,
# not the 2x of the peaks). Held out: the same recipes on 256 chips (+0.7%, +0.1%), the
# re-tuned fp8 recipe (-2.5%, ranked above the original as published) and the
# llama3.1-405b rows (bf16 -2.6%, fp8 -6.1%). Every row is FSDP with its collectives on the
# SparseCores, which the rows cannot tell apart from MXU time, so `OVERLAP` stays at 0
# (asynchronous collectives and host transfers never hidden): the pessimistic rule.
MXU_EFFICIENCY = 0.78
FP8_MXU_EFFICIENCY = 0.66
OVERLAP = 0.0
F32_MATMUL_SHARE = 0.25  # an f32 matmul runs as several bf16 passes on the MXU

_MOVED = {  # bytes a device sends per byte counted (result for all-gather, else operand)
    "all-gather": lambda n: (n - 1) / n,
    "reduce-scatter": lambda n: (n - 1) / n,
    "all-reduce": lambda n: 2 * (n - 1) / n,
    "all-to-all": lambda n: (n - 1) / n,
    "ragged-all-to-all": lambda n: (n - 1) / n,
    "collective-permute": lambda n: 1.0,
}


def step_time(
    cost: dict[str, Any],
    accel: Accelerator,
    kernel_flops: float = 0.0,
    mxu_efficiency: float = MXU_EFFICIENCY,
    overlap: float = OVERLAP,
    fp8_mxu_efficiency: float = FP8_MXU_EFFICIENCY,
) -> dict[str, Any]:
    """Seconds per step on one device of `accel` for a program of `cost` (per device)."""
    per_device = accel.devices_per_chip
    peak = {p: t * 1e12 / per_device for p, t in accel.peak_tflops.items()}
    flops = cost["flops"]
    compute = (
        flops.get("fp8", 0.0) / (peak.get("fp8", peak["bf16"]) * fp8_mxu_efficiency)
        + (
            (flops.get("bf16", 0.0) + kernel_flops) / peak["bf16"]
            + flops.get("f32", 0.0) / (peak["bf16"] * F32_MATMUL_SHARE)
        )
        / mxu_efficiency
    )
    hbm_rate = accel.hbm_bytes_per_s / per_device
    hbm = cost["hbm_bytes"] / hbm_rate
    # Ops without matrix products run between the MXU's (one op at a time): their HBM time
    # adds; matmul ops overlap their own HBM traffic (records from before the split: none).
    alone = cost.get("hbm_bytes_without_matmul", 0.0) / hbm_rate
    ici_per_device = accel.ici_axis_bytes_per_s / per_device
    ici_sync, ici_async = _ici_seconds(cost, ici_per_device)
    ici = ici_sync + ici_async
    host = cost["host_transfer_bytes"] / (accel.host_link_bytes_per_s / per_device)
    busy = max(compute, hbm - alone) + alone
    # A synchronous collective stops the TensorCore; offloaded (SparseCore) and asynchronous
    # collectives and host transfers run beside it, hidden behind `overlap` of its busy time.
    exposed = ici_sync + max(0.0, ici_async + host - overlap * busy)
    step = busy + exposed
    return {
        "est_step_time_s": step,
        "est_compute_s": compute,
        "est_hbm_s": hbm,
        "est_ici_s": ici,
        "est_host_s": host,
        "est_exposed_comm_s": exposed,
        "bound": max({"compute": compute, "hbm": hbm, "ici": ici}.items(), key=lambda kv: kv[1])[0],
    }


def _ici_seconds(cost: dict[str, Any], per_device_bytes_per_s: float) -> tuple[float, float]:
    """(synchronous, asynchronous) seconds of the program's collectives: each one's bytes,
    ring-corrected by its group size, over one torus axis's share per device times the torus
    dimensions its rings use at once. A cost counted before collectives were told apart
    (no `collective_ops`): each kind at its largest group, one axis, asynchronous."""
    ops = cost.get("collective_ops")
    if ops is None:
        ops = [
            {"kind": kind, "group": max(cost["collective_group_sizes"].get(kind) or [1]),
             "torus_dims": 1, "engine": "async", "bytes": moved}
            for kind, moved in cost["collective_bytes"].items()
        ]  # fmt: skip
    seconds = {"sync": 0.0, "async": 0.0}
    for op in ops:
        moved = op["bytes"] * _MOVED[op["kind"]](op["group"])
        time = moved / (per_device_bytes_per_s * op["torus_dims"])
        seconds["sync" if op["engine"] == "sync" else "async"] += time
    return seconds["sync"], seconds["async"]


def kernel_flops(
    config,
    global_batch: int,
    num_devices: int,
    context: int = 1,
    calls: list | None = None,
    expert: int = 1,
) -> float:
    """Per-device FLOPs of the Mosaic kernels a TPU program calls, which its HLO cannot show:
    Splash attention (causal, as its blocks compute it) and the grouped expert matmuls of
    Megablox or tokamax, for each call the program makes (`calls`, from hlo_cost: a
    recomputed forward counts again), as its tiles compute it; without the calls (a record
    from before they were read), the model formula's terms. `expert`: the mesh's expert
    degree."""
    m = config.model
    kernels = config.resolved_kernels("tpu", context)
    flops = 0.0
    if kernels.attention == "splash":
        per_matmul = 2 * global_batch * m.num_heads * m.head_dim / num_devices  # per score
        s = config.seq_len
        if context == 1:
            blocks = kernels.blocks(s, s)
            forward = splash_scores(s, blocks["block_q"], blocks["block_kv"])
            backward = splash_scores(s, blocks["block_q_dkv"], blocks["block_kv_dkv"])
        else:  # context parallelism: blocks of a sharded mask, not counted (the causal half)
            forward = backward = s * s / 2
        # Each call the program makes: a forward runs QK^T and PV; the backward QK^T again,
        # dP, dV and dK, and dQ (fused into the dK/dV kernel unless a dQ kernel runs apart,
        # which also recomputes QK^T and dP). A forward recomputed for the backward (its
        # residuals not saved) is a second forward call.
        splash = [c for c in calls or () if c["name"].startswith("splash_")]
        passes = {
            p: sum(c["times"] for c in splash if f"_{p}" in c["name"]) for p in ("fwd", "dkv", "dq")
        }
        dkv_matmuls = 4 if passes["dq"] else 5
        if passes["fwd"] and passes["dkv"]:
            flops += per_matmul * (
                2 * passes["fwd"] * forward
                + (dkv_matmuls * passes["dkv"] + 3 * passes["dq"]) * backward
            )
        else:  # a record from before kernel calls were read: one forward, backward 2x
            flops += 2 * per_matmul * (forward + 2 * backward) * m.num_layers
    if not (m.is_moe and kernels.moe_gmm in ("megablox", "tokamax")):
        return flops
    gmm = [c for c in calls or () if c["name"].startswith(GROUPED_MATMULS) and c["flops"]]
    if gmm:
        groups = m.num_experts // expert  # experts on each device
        return flops + sum(c["times"] * grouped_matmul_flops(c, groups) for c in gmm)
    tokens = global_batch * config.seq_len
    expert_mlp = 2 * tokens * m.mlp_dim * m.d_model * 3 * m.experts_per_token
    return flops + expert_mlp * m.num_layers * 3 / num_devices


# The grouped-matmul kernels by their HLO names: Megablox's gmm and tgmm, tokamax's
# (gmm_megablox, tgmm_megablox: pipelined by hand, no blocks to read) and libtpu's lowering of
# XLA's ragged_dot (ragged-dot-*).
GROUPED_MATMULS = ("gmm", "tgmm", "ragged-dot-")


def grouped_matmul_flops(call: dict, groups: int) -> float:
    """FLOPs one grouped-matmul kernel call computes: whole (tm, tk, tn) tiles (its blocks),
    over at most m/tm + G - 1 row tiles (a row tile two groups share runs once for each: the
    kernels' group metadata; routed rows rarely end on a tile edge), its contraction and
    columns padded to whole tiles. gmm's output is [m, n] (contracting k), tgmm's [G, k, n]
    (contracting m); the cost estimate is 2mkn. Without the blocks: the cost estimate."""
    if not call["blocks"]:
        return call["flops"]
    (tm, tk), tn = call["blocks"][0][-2:], call["blocks"][-1][-1]
    if len(call["out"]) == 3:
        groups, k, n = call["out"]
        rows = call["flops"] / (2 * k * n)
    else:
        rows, n = call["out"]
        k = call["flops"] / (2 * rows * n)
    row_tiles = math.ceil(rows / tm) + groups - 1
    return 2 * row_tiles * tm * math.ceil(k / tk) * tk * math.ceil(n / tn) * tn


def splash_scores(seq: int, block_q: int, block_kv: int) -> float:
    """Score elements a causal Splash kernel computes: it skips the (block_q, block_kv)
    blocks the mask covers whole and computes every other block in full, so a block on the
    diagonal costs as much as one under it (2048-row blocks at 8k: 1.25x the causal half)."""
    rows = seq // block_q
    per_row = (min(seq // block_kv, math.ceil((i + 1) * block_q / block_kv)) for i in range(rows))
    return sum(per_row) * block_q * block_kv
