"""Step time from the compiled program: its counted work (trainer/compile/cost.py) over the
chip's datasheet rates, with explicit overlap rules (fidelity: estimate, from a compile).

- compute: matrix FLOPs by precision over the peak of that precision, at `MXU_EFFICIENCY`
  (bf16, f32) or `FP8_MXU_EFFICIENCY` (fp8 dots, and kernels with fp8 operands: fp8
  experts' grouped matmuls); Mosaic kernels (the HLO cannot look
  into them) add the FLOPs their tiles compute: Splash attention its blocks (their sizes
  decide how much of the causal mask's diagonal it computes in vain), a grouped matmul its
  whole row tiles, one more per expert boundary inside a tile (trainer/compile/mosaic.py reads
  each call's tiles from the compiled program); each kernel matmul over the share of the
  MXU its held tile fills (`mxu_fill`: on TPU7x's 256-wide array a 128-wide head or tile
  leaves half idle); a kernel call takes at least `GRID_STEP_S` per grid step (a step
  costs that much however little it computes: many small blocks cost more than the FLOPs
  they skip). A grouped matmul also waits on its experts' tiles: each expert's weight tiles
  (tgmm: its weight-gradient tiles) cross HBM once a call while the MXU idles
  (`grouped_matmul_waits`; tokamax's TPU7x timings, benchmarks/kernel_reference.py).
- HBM: bytes the top-level ops read and write, VMEM-resident values excluded; a slice of a
  stacked (scanned) buffer costs the slice.
- ICI: bytes each collective moves per device, ring-corrected by its group size, over the
  device's share of the chip's bidirectional ICI bandwidth on one torus axis, times the
  torus dimensions its rings use at once (libtpu's backend config: 3 where colors rotate
  over X, Y and Z, 1 for a single ring).
- host: bytes moved to or from pinned host memory (offload), over the host link.
- SparseCores: the HBM bytes of the work libtpu runs there (MoE routing's gathers and
  scatters, layout conversions) at the SparseCores' gather rate (`Accelerator.
  sparsecore_bytes_per_s`: TPU7x's is the JAX SparseCore guide's measurement, 0.29 of the HBM
  rate); their collectives at the ICI rate. One op at a time, as every engine here.
- DCN (multi-slice programs): bytes each cross-slice collective hands the data center
  network per device (libtpu's megascale `send`s), ring-corrected by the slices it spans,
  over the device's share of its chip's DCN bandwidth (datasheet), one collective at a time.
- overlap, from the program's own schedule (hlo_cost `schedule`): the TensorCore runs its
  ops one at a time in the compiled order (a matmul op's HBM traffic hides under its
  compute, the larger counts; an op without matmuls is HBM time); an asynchronous op (a
  collective or a copy offloaded to the SparseCores, a `-start`/`-done` pair, a host
  transfer) starts when the TensorCore reaches it and its engine is free, and stalls the
  TensorCore only where the schedule waits for it (its `-done`) before it has finished; a
  synchronous collective or host transfer stalls it for its whole time. Loops run their
  body twice and repeat the second time, so an op started in one iteration and waited for
  in the next overlaps as it does on the chip.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NamedTuple

from trainer.compile.mosaic import GROUPED_MATMULS
from trainer.compile.schedule import Call, Done, Loop, Schedule, Start, TensorCoreOp, Wait, Work
from trainer.trial.hardware import Accelerator
from trainer.trial.mxu import (
    F32_MATMUL_SHARE,
    FP8_MXU_EFFICIENCY,
    GRID_STEP_S,
    INT8_MXU_EFFICIENCY,
    MXU_EFFICIENCY,
    flops_per_score,
    kernel_efficiency,
    mxu_fill,
    rescale_seconds,
    splash_fills,
    splash_score_counts,
    splash_work,
    whole_tiles,
)

_MOVED = {  # bytes a device sends per byte counted (result for all-gather, else operand)
    "all-gather": lambda n: (n - 1) / n,
    "reduce-scatter": lambda n: (n - 1) / n,
    "all-reduce": lambda n: 2 * (n - 1) / n,
    "all-to-all": lambda n: (n - 1) / n,
    "ragged-all-to-all": lambda n: (n - 1) / n,
    "collective-permute": lambda n: 1.0,
}


class KernelFlops(NamedTuple):
    total: float  # per device per step
    each: list[float]  # one execution of each call, in the order of the calls
    steps: Sequence[float] = ()  # grid steps of one execution of each call, in the same order
    # HBM bytes one execution of each call moves while the MXU waits (`grouped_matmul_waits`)
    waits: Sequence[float] = ()
    # Splash's accumulator elements one execution of each call rescales (`splash_work`)
    rescaled: Sequence[float] = ()


def step_time(
    cost: dict[str, Any],
    accel: Accelerator,
    kernels: KernelFlops | None = None,
    mxu_efficiency: float = MXU_EFFICIENCY,
    fp8_mxu_efficiency: float = FP8_MXU_EFFICIENCY,
) -> dict[str, Any]:
    """Seconds per step on one device of `accel` for a program of `cost` (per device, with
    its schedule: trainer/compile/cost.py). `kernels`: the Mosaic kernels' FLOPs
    (`kernel_flops`), each call's placed where the schedule runs it; without them, each call
    at its cost estimate."""
    rates = _Rates(accel, mxu_efficiency, fp8_mxu_efficiency)
    flops = cost["flops"]
    calls = cost["kernel_calls"]
    kernels = kernels or KernelFlops(0.0, [])
    kernels = kernels._replace(  # what is not counted: each call's cost estimate, static grid
        each=kernels.each or [c["flops"] or 0.0 for c in calls],
        steps=kernels.steps or [_grid_product(c) for c in calls],
    )
    terms = _call_terms(calls, kernels)
    prices = [CallPrice.of(c, accel) for c in calls]
    # each call's compute as `kernel_seconds` prices it, its waits apart (`_run` adds them)
    call_s = [rates.kernel(t, p) for t, p in zip(terms, prices, strict=True)]
    compute = rates.compute(flops.get("fp8", 0.0), flops.get("bf16", 0.0), flops.get("f32", 0.0),
                            flops.get("int8", 0.0))  # fmt: skip
    # the kernels' FLOPs alone (their grid steps apart, below)
    compute += sum(c["times"] * rates.at(t.flops, t.fp8, p.efficiency)
                   for c, t, p in zip(calls, terms, prices, strict=True))  # fmt: skip
    steps, waits = [t.steps for t in terms], [t.waits for t in terms]
    hbm = cost["hbm_bytes"] / rates.hbm
    ici = sum(rates.ici(op["kind"], op["group"], op["torus_dims"], op["bytes"])
              for op in cost["collective_ops"])  # fmt: skip
    host = cost["host_transfer_bytes"] / rates.host
    dcn = sum(
        (rates.dcn(op["kind"], op["group"], op["bytes"]) for op in cost.get("dcn_ops", [])), 0.0
    )
    program = cost["schedule"]
    if not isinstance(program, Schedule):  # as JSON, from a record or an event
        program = Schedule.model_validate(program)
    busy, step = _run(program, rates, call_s, waits)
    return {
        "est_step_time_s": step,
        "est_compute_s": compute,
        "est_hbm_s": hbm,
        "est_ici_s": ici,
        "est_host_s": host,
        "est_dcn_s": dcn,
        # the kernels' grid steps at GRID_STEP_S: a floor under their compute time (Splash's
        # where its rescales are measured: on top of it)
        "est_grid_steps_s": sum(c["times"] * n for c, n in zip(calls, steps, strict=True))
        * GRID_STEP_S,
        "est_kernel_waits_s": sum(c["times"] * w for c, w in zip(calls, waits, strict=True))
        / rates.hbm,
        "est_busy_s": busy,
        "est_exposed_comm_s": step - busy,
        "bound": max(
            {"compute": compute, "hbm": hbm, "ici": ici, "dcn": dcn}.items(), key=lambda kv: kv[1]
        )[0],
    }


class KernelTerms(NamedTuple):
    """What one execution of a kernel call is priced by: its FLOPs (over the MXU share its
    blocks fill, `kernel_flops`), grid steps, the HBM bytes it waits on
    (`grouped_matmul_waits`), whether its operands are fp8, and the accumulator elements a
    Splash call rescales."""

    flops: float
    steps: float
    waits: float = 0.0
    fp8: bool = False
    rescaled: float = 0.0


class CallPrice(NamedTuple):
    """A call's family's measured constants on a chip (None: not measured there)."""

    efficiency: float | None = None  # `kernel_efficiency`; None: the whole step's
    rescale_s: float | None = None  # `rescale_seconds`; None: its grid steps a floor

    @classmethod
    def of(cls, call: dict, accel: Accelerator) -> CallPrice:
        prefix = accel.topology_prefix
        return cls(kernel_efficiency(prefix, call), rescale_seconds(prefix, call))


def kernel_seconds(
    terms: KernelTerms,
    accel: Accelerator,
    price: CallPrice,
    mxu_efficiency: float = MXU_EFFICIENCY,
) -> float:
    """One kernel call's time as the step model runs it: its FLOPs at the MXU's rate (fp8's,
    for fp8 operands) times its family's efficiency (`price`; None: the whole step's); its
    grid steps at GRID_STEP_S a floor under that, or, where its family's accumulator rescales
    are priced (Splash's), a toll with them; then the HBM bytes it waits on."""
    rates = _Rates(accel, mxu_efficiency, FP8_MXU_EFFICIENCY)
    return rates.kernel(terms, price) + terms.waits / rates.hbm


def calls_seconds(calls: list[dict], kernels: KernelFlops, accel: Accelerator) -> list[float]:
    """Each call's time for one execution, as `kernel_seconds` prices it at its family's
    constants on `accel` (`kernel_flops` of the same calls)."""
    terms = _call_terms(calls, kernels)
    return [
        kernel_seconds(t, accel, CallPrice.of(c, accel)) for c, t in zip(calls, terms, strict=True)
    ]


def _call_terms(calls: list[dict], kernels: KernelFlops) -> list[KernelTerms]:
    """Each call's `KernelTerms` from `kernel_flops` of the same calls (none counted: 0)."""
    none = [0.0] * len(calls)
    return [
        KernelTerms(f, n, w, c.get("precision") == "fp8", r)
        for c, f, n, w, r in zip(calls, kernels.each, kernels.steps or none,
                                 kernels.waits or none, kernels.rescaled or none, strict=True)
    ]  # fmt: skip


class _Rates:
    """Seconds of work on one device of `accel`."""

    def __init__(self, accel: Accelerator, mxu: float, fp8_mxu: float) -> None:
        self.peak = {p: accel.peak_flops_per_device(p) for p in accel.peak_tflops}
        self.mxu, self.fp8_mxu = mxu, fp8_mxu
        self.int8_mxu = INT8_MXU_EFFICIENCY.get(accel.topology_prefix, mxu)
        self.hbm = accel.hbm_bytes_per_s_per_device
        self.ici_axis = accel.ici_axis_bytes_per_s_per_device
        self.host = accel.host_link_bytes_per_s_per_device
        self.dcn_per_device = accel.dcn_bytes_per_s_per_device
        self.sparsecore = accel.sparsecore_bytes_per_s_per_device

    def compute(self, fp8: float, bf16: float, f32: float, int8: float = 0.0) -> float:
        """Matrix FLOPs at each precision's peak and efficiency (int8 at its own where it was
        fitted, trainer.trial.mxu's INT8_MXU_EFFICIENCY; else bf16's)."""
        peak = self.peak["bf16"]
        return (
            fp8 / (self.peak.get("fp8", peak) * self.fp8_mxu)
            + int8 / (self.peak.get("int8", peak) * self.int8_mxu)
            + (bf16 / peak + f32 / (peak * F32_MATMUL_SHARE)) / self.mxu
        )

    def at(self, flops: float, fp8: bool, efficiency: float | None) -> float:
        """A kernel's FLOPs (fp8 or bf16 operands) at `efficiency` of its precision's peak
        (None: the whole step's efficiency of that precision)."""
        if efficiency is None:
            return self.compute(flops, 0.0, 0.0) if fp8 else self.compute(0.0, flops, 0.0)
        return flops / (self.peak.get("fp8" if fp8 else "bf16", self.peak["bf16"]) * efficiency)

    def kernel(self, terms: KernelTerms, price: CallPrice) -> float:
        """One kernel call's compute, as `kernel_seconds` prices it less its waits."""
        compute = self.at(terms.flops, terms.fp8, price.efficiency)
        if price.rescale_s is None:
            return max(compute, terms.steps * GRID_STEP_S)
        return compute + terms.steps * GRID_STEP_S + terms.rescaled * price.rescale_s

    def ici(self, kind: str, group: int, torus_dims: int, counted: float) -> float:
        """A collective's bytes, ring-corrected by its group size, over one torus axis's
        share per device times the torus dimensions its rings use at once."""
        return counted * _MOVED[kind](group) / (self.ici_axis * torus_dims)

    def dcn(self, kind: str, group: int, counted: float) -> float:
        """A collective between slices: its bytes, ring-corrected by the slices it spans, over
        the device's share of its chip's data center network bandwidth."""
        if not self.dcn_per_device:
            raise ValueError("a multi-slice program on an accelerator with no DCN bandwidth")
        # A transfer type with no ring rule here (a point-to-point one) moves its bytes once.
        moved = _MOVED.get(kind, _MOVED["collective-permute"])(group)
        return counted * moved / self.dcn_per_device

    def work(self, work: Work, engine: str = "") -> float:
        """An asynchronous or waited-for op: its collectives, then its HBM and host bytes
        (on the SparseCores, HBM bytes at the rate they gather and scatter)."""
        return (
            sum(self.ici(r.kind, r.group, r.torus_dims, r.bytes) for r in work.ici)
            + sum(self.dcn(r.kind, r.group, r.bytes) for r in work.dcn)
            + work.hbm / (self.sparsecore if engine == "sparsecore" else self.hbm)
            + work.host / self.host
        )


def _run(
    schedule: Schedule, rates: _Rates, call_seconds: list[float], call_waits: Sequence[float]
) -> tuple[float, float]:
    """(TensorCore busy seconds, step seconds) of the scheduled program. The TensorCore runs
    its ops one after another (a matmul op's HBM traffic under its compute, the larger
    counts); an asynchronous op starts when both the TensorCore reaches it and its engine is
    free, runs beside the TensorCore, and stalls it only at its `-done` if not finished by
    then. A loop runs its body twice (so that an op started in one iteration and waited for
    in the next overlaps as on the chip) and the second iteration's time stands for the rest."""
    clock = _Clock(schedule, rates, call_seconds, call_waits)
    clock.run(schedule.entry)
    return clock.busy, max(clock.tc, *clock.free.values(), 0.0)


class _Clock:
    """The TensorCore's clock and each engine's, as `_run` walks the schedule."""

    def __init__(
        self,
        schedule: Schedule,
        rates: _Rates,
        call_seconds: list[float],
        call_waits: Sequence[float],
    ) -> None:
        self.schedule, self.rates = schedule, rates
        self.call_seconds, self.call_waits = call_seconds, call_waits
        self.tc = self.busy = 0.0
        self.free: dict[str, float] = {}  # when each engine is next free
        self.finish: dict[str, float] = {}  # when each started op ends

    def op_seconds(self, event: TensorCoreOp) -> float:
        seconds = self.rates.compute(event.fp8, event.bf16, event.f32, event.int8)
        waits = 0.0
        if event.kernel >= 0:
            seconds += self.call_seconds[event.kernel]
            waits = self.call_waits[event.kernel] / self.rates.hbm
        memory = event.hbm / self.rates.hbm
        return (max(seconds, memory) if event.matmul else memory) + waits

    def run(self, name: str) -> None:
        for event in self.schedule.computations.get(name, []):
            match event:
                case TensorCoreOp():
                    seconds = self.op_seconds(event)
                    self.tc += seconds
                    self.busy += seconds
                case Wait():
                    self.tc += self.rates.work(event.work)
                case Start():
                    begin = max(self.tc, self.free.get(event.engine, 0.0))
                    ends = begin + self.rates.work(event.work, event.engine)
                    self.free[event.engine] = self.finish[event.name] = ends
                case Done():  # one whose start is not in sight: wait for every engine
                    ends = self.finish.pop(event.name, max(self.free.values(), default=0.0))
                    self.tc = max(self.tc, ends)
                case Call():
                    self.run(event.callee)
                case Loop():
                    self.loop(event)

    def loop(self, event: Loop) -> None:
        if event.trips >= 1:
            self.run(event.body)
        if event.trips < 2:
            return
        tc, busy = self.tc, self.busy
        self.run(event.body)
        shift = (event.trips - 2) * (self.tc - tc)
        self.busy += (event.trips - 2) * (self.busy - busy)
        self.tc += shift
        for times in (self.free, self.finish):
            for key, at in times.items():
                if at > tc:
                    times[key] = at + shift


def kernel_flops(
    config,
    global_batch: int,
    num_devices: int,
    context: int = 1,
    calls: list | None = None,
    expert: int = 1,
    mxu_width: int = 0,
) -> KernelFlops:
    """Per-device FLOPs of the Mosaic kernels a TPU program calls, which its HLO cannot show,
    in all and for one execution of each call (`calls`, the cost's `kernel_calls`, in order): a
    Splash forward call 2 matmuls per score it computes (causal, as its blocks compute it);
    a backward QK^T again, dP, dV and dK, and dQ (fused into the dK/dV kernel unless a dQ
    kernel runs apart, which also recomputes QK^T and dP); a forward the backward recomputes
    is another call; a grouped matmul (Megablox, tokamax, libtpu's ragged_dot) its whole
    tiles (`grouped_matmul_flops`); any other kernel its cost estimate. Without calls (no
    compiled program to read them from), the formula's terms. `expert`: the mesh's
    expert degree. `mxu_width` (the chip's, `Accelerator.mxu_width`): count the FLOPs the
    MXU spends, each kernel matmul over its share of the array (`mxu_fill`); 0: as computed."""
    each = _each_call(
        config, global_batch, num_devices, context, list(calls or ()), expert, mxu_width
    )
    if calls and any(each):
        total = sum(c["times"] * f for c, f in zip(calls, each, strict=True))
        steps = [grid_steps(c, config, global_batch, num_devices, context, expert) for c in calls]
        groups = config.model.num_experts // expert if config.model.is_moe else 1
        waits = [grouped_matmul_waits(c, groups) for c in calls]
        rescaled = [_rescaled(c, config, global_batch, num_devices, context) for c in calls]
        return KernelFlops(total, each, steps, waits, rescaled)
    # No program: per layer one forward, and a backward of twice its FLOPs.
    m = config.model
    kernels = config.resolved_kernels("tpu", context)
    flops = 0.0
    if kernels.attention == "splash":
        splash = splash_work(config, global_batch, num_devices, context, mxu_width)
        flops += m.num_layers * (splash["forward_flops"] + splash["backward_flops"])
    if m.is_moe and kernels.moe_gmm in ("megablox", "tokamax"):
        tokens = global_batch * config.seq_len
        expert_mlp = 2 * tokens * m.mlp_dim * m.d_model * 3 * m.experts_per_token
        flops += expert_mlp * m.num_layers * 3 / num_devices
    return KernelFlops(flops, each)


def _each_call(
    config,
    global_batch: int,
    num_devices: int,
    context: int,
    calls: list,
    expert: int,
    mxu_width: int,
) -> list[float]:
    """FLOPs of one execution of each call (see `kernel_flops`)."""
    m = config.model
    kernels = config.resolved_kernels("tpu", context)
    forward, backward = splash_score_counts(config, context)
    per_score = flops_per_score(config, global_batch, num_devices)
    fused_dq = not any("_dq" in c["name"] for c in calls if c["name"].startswith("splash_"))
    fill_fwd, fill_dkv, fill_dq = splash_fills(config, context, mxu_width, fused_dq)
    groups = m.num_experts // expert if m.is_moe else 1  # experts on each device
    each = []
    for call in calls:
        name = call["name"]
        if name.startswith("splash_") and kernels.attention == "splash":
            if "_fwd" in name:
                each.append(2 * per_score * forward / fill_fwd)
            elif "_dkv" in name:
                each.append((5 if fused_dq else 4) * per_score * backward / fill_dkv)
            elif "_dq" in name:
                each.append(3 * per_score * backward / fill_dq)
            else:
                each.append(call["flops"])
        elif name.startswith(GROUPED_MATMULS) and call["flops"]:
            each.append(grouped_matmul_flops(call, groups, mxu_width))
        else:
            each.append(call["flops"] or 0.0)
    return each


def grid_steps(
    call: dict, config, global_batch: int, num_devices: int, context: int = 1, expert: int = 1
) -> float:
    """Grid steps one execution of a kernel call runs. Splash: every (query block, key
    block) pair of each sequence and head on the device, the blocks the causal mask skips
    included (they skip the work, not the step); its forward's grid has a dynamic axis, so
    this is counted from the blocks. A grouped matmul: its (tm, tk, tn) tiles, over the row
    tiles `grouped_matmul_flops` counts. Any other kernel: its grid's static size (1 where
    it has none)."""
    name = call["name"]
    if name.startswith("splash_") and context == 1:
        splash = splash_work(config, global_batch, num_devices)
        return splash["forward_steps" if "_fwd" in name else "backward_steps"]
    if name.startswith(GROUPED_MATMULS) and call["flops"] and _tiles(call):
        m = config.model
        return _grouped_tiles(call, m.num_experts // expert if m.is_moe else 1)[1]
    return _grid_product(call)


def _rescaled(call: dict, config, global_batch: int, num_devices: int, context: int) -> float:
    """The accumulator elements one execution of a Splash call rescales (`splash_work`); 0
    for any other kernel."""
    kernels = config.resolved_kernels("tpu", context)
    if not call["name"].startswith("splash_") or kernels.attention != "splash":
        return 0.0
    splash = splash_work(config, global_batch, num_devices, context)
    return splash["forward_rescaled" if "_fwd" in call["name"] else "backward_rescaled"]


def _grid_product(call: dict) -> float:
    """The static size of a kernel call's grid (a dynamic axis counts once); 1 without one."""
    return float(math.prod(b or 1 for b in call.get("grid") or ()))


def grouped_matmul_flops(call: dict, groups: int, mxu_width: int = 0) -> float:
    """FLOPs one grouped-matmul kernel call computes: whole (tm, tk, tn) tiles (the tiling
    its metadata states, as tokamax's kernels do, else read from its blocks), over at most
    m/tm + G - 1 row tiles (a row tile two groups share runs once for each: the kernels'
    group metadata; routed rows rarely end on a tile edge), its contraction and columns
    padded to whole tiles. gmm's output is [m, n] (contracting k), tgmm's [G, k, n]
    (contracting m); the cost estimate is 2mkn. Without tiles: the cost estimate. With
    `mxu_width`, over the MXU share of the tile it holds (`mxu_fill`): gmm its (tk, tn)
    weight tile, tgmm its (tm, tn) gradient tile."""
    if not _tiles(call):
        return call["flops"]
    flops, _, held = _grouped_tiles(call, groups)
    return flops / mxu_fill(mxu_width, *held)


def grouped_matmul_waits(call: dict, groups: int) -> float:
    """HBM bytes a grouped-matmul call moves while the MXU waits: each expert's tiles once a
    call, padded to whole tiles (gmm: its weights, read when its rows begin; tgmm: its weight
    gradient, written when they end), in the operands' width (the gradient's 2 bytes).
    tokamax's own timings of its kernels on TPU7x show it: with 128-row tiles and 256 experts
    the time is the tiles' compute plus every expert's weights read (3.8 ms measured, 3.8
    modelled), where the compute alone would be 2.8 (benchmarks/kernel_reference.py). 0 for
    any other kernel, or a call whose tiles are not stated."""
    if not call["name"].startswith(GROUPED_MATMULS) or not call["flops"] or not _tiles(call):
        return 0.0
    _, tk, tn = _tiles(call) or (1, 1, 1)
    _, k, n, tgmm = _grouped_dims(call)
    width = 2 if tgmm or call.get("precision") != "fp8" else 1
    return float(groups * math.ceil(k / tk) * tk * math.ceil(n / tn) * tn * width)


def _grouped_dims(call: dict) -> tuple[float, float, float, bool]:
    """A grouped-matmul call's (rows, contracted or weight rows k, columns n, whether it is a
    tgmm): gmm's output is [m, n], contracting k; tgmm's [G, k, n], contracting the rows."""
    if len(call["out"]) == 3:
        _, k, n = call["out"]
        return call["flops"] / (2 * k * n), k, n, True
    rows, n = call["out"]
    return rows, call["flops"] / (2 * rows * n), n, False


def _grouped_tiles(call: dict, groups: int) -> tuple[float, int, tuple[int, int]]:
    """A grouped-matmul call's FLOPs in whole tiles, its tile count (its grid steps), and
    the (rows, columns) of the tile the MXU holds (see `grouped_matmul_flops`)."""
    tm, tk, tn = _tiles(call) or (1, 1, 1)
    rows, k, n, tgmm = _grouped_dims(call)
    if tgmm:
        groups = call["out"][0]
    held = (tm, tn) if tgmm else (tk, tn)
    tiles = whole_tiles(rows, k, n, (tm, tk, tn), groups)
    return 2.0 * tiles * tm * tk * tn, tiles, held


def _tiles(call: dict) -> tuple[int, int, int] | None:
    """A grouped-matmul call's (tm, tk, tn): the tiling its metadata states, else read from
    its blocks; None without either."""
    if call.get("tiling"):
        return tuple(call["tiling"])
    if call["blocks"]:
        (tm, tk), tn = call["blocks"][0][-2:], call["blocks"][-1][-1]
        return tm, tk, tn
    return None
