"""What a compiled program does per step, read from its optimized HLO (fidelity: compile).

XLA's own cost analysis counts a scanned layer once; this walk multiplies every op by the
trip counts of the loops around it. It reads TPU HLO as libtpu prints it: operands by name
(their shapes from their definitions), matrix products as `convolution`s with
`dim_labels` (the batched-dot window trick included), loop bounds in the condition. What
each op costs is trainer/compile/ops.py; the order the ops run in, trainer/compile/schedule.py.
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass, field

from trainer.compile.ops import (
    KernelKey,
    collective_op,
    dcn_op,
    host_bytes,
    kernel_key,
    matmul_flops,
    op_hbm_bytes,
    precision_of,
    trips_of,
    with_matmuls,
)
from trainer.compile.schedule import schedule
from trainer.program.hlo import ASYNC_CALLS, Instr, Module, called, callee, parse


@dataclass
class Cost:
    """Per device, per step (loops unrolled by trip count)."""

    flops: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    hbm_bytes: float = 0.0
    hbm_bytes_without_matmul: float = 0.0  # of ops with no matrix product: never under the MXU
    collective_bytes: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    collective_group_sizes: dict[str, set] = field(default_factory=lambda: defaultdict(set))
    # bytes by (kind, group size, torus dims its rings use at once, engine): see `collective`
    collective_ops: dict[tuple[str, int, int, str], float] = field(
        default_factory=lambda: defaultdict(float)
    )
    # bytes by (kind, slices) of collectives between slices (multi-slice programs: `dcn_op`)
    dcn_ops: dict[tuple[str, int], float] = field(default_factory=lambda: defaultdict(float))
    host_transfer_bytes: float = 0.0
    custom_calls: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    # Mosaic kernel calls (see `ops.KernelKey`), in the order the walk meets them
    kernel_calls: dict[KernelKey, float] = field(default_factory=lambda: defaultdict(float))
    loop_trips: list[int] = field(default_factory=list)

    def as_dict(self) -> dict:
        return {
            "flops": dict(self.flops),
            "flops_total": sum(self.flops.values()),
            "hbm_bytes": self.hbm_bytes,
            "hbm_bytes_without_matmul": self.hbm_bytes_without_matmul,
            "collective_bytes": dict(self.collective_bytes),
            "collective_group_sizes": {
                k: sorted(v) for k, v in self.collective_group_sizes.items()
            },
            "collective_ops": [
                {"kind": k, "group": g, "torus_dims": d, "engine": e, "bytes": b}
                for (k, g, d, e), b in sorted(self.collective_ops.items())
            ],
            "dcn_ops": [
                {"kind": k, "group": g, "bytes": b} for (k, g), b in sorted(self.dcn_ops.items())
            ],
            "host_transfer_bytes": self.host_transfer_bytes,
            "custom_calls": dict(self.custom_calls),
            "kernel_calls": [
                {**key._asdict(), "out": list(key.out), "times": times}
                for key, times in self.kernel_calls.items()
            ],
            "loop_trips": self.loop_trips,
        }


def _count(
    cost: Cost,
    instr: Instr,
    module: Module,
    times: float,
    in_async: bool,
    top_level: bool,
    matmul_bodies: set[str],
) -> None:
    """One instruction's work, run `times` a step, added to `cost`."""
    computations, types, op = module.computations, module.types, instr.opcode
    if op in ("dot", "convolution"):
        cost.flops[precision_of(instr, types)] += matmul_flops(instr, types) * times
    found = collective_op(instr, in_async, types)
    if found:
        cost.collective_bytes[found.kind] += found.bytes * times
        cost.collective_group_sizes[found.kind].add(found.group)
        how = (found.kind, found.group, found.torus_dims, found.engine)
        cost.collective_ops[how] += found.bytes * times
    between = dcn_op(instr, types)
    if between:
        cost.dcn_ops[between.kind, between.group] += between.bytes * times
    if op == "custom-call":
        call = re.search(r'custom_call_target="([^"]*)"', instr.attrs)
        if call and not call.group(1).startswith(("PrepareAsync", "Allocate")):
            cost.custom_calls[call.group(1)] += times
        key = kernel_key(instr, types)
        if key:
            cost.kernel_calls[key] += times
    moved = op_hbm_bytes(instr, computations, types) * times if top_level else 0.0
    cost.hbm_bytes += moved
    # The TensorCore runs one op at a time: an op without matrix products (a copy, an
    # elementwise or reduction fusion) is HBM time no matmul hides. Mosaic kernels (custom
    # calls) count as matmul work: their FLOPs come from formulas.
    if (
        moved
        and op not in ("dot", "convolution", "custom-call")
        and (callee(instr) or "") not in matmul_bodies
    ):
        cost.hbm_bytes_without_matmul += moved
    cost.host_transfer_bytes += host_bytes(instr, types) * times


def program_cost(hlo: str | Module) -> dict:
    """The per-device cost of one step of a compiled program (see module docstring), with
    its `schedule` (trainer/compile/schedule.py, as JSON)."""
    module = parse(hlo) if isinstance(hlo, str) else hlo
    computations = module.computations
    cost = Cost()
    by_name = {i.name: i for i in module.instructions()}
    matmul_bodies = with_matmuls(computations)
    fused = {body for i in module.instructions() if i.opcode == "fusion" and (body := callee(i))}

    def walk(name: str, times: float, seen: tuple[str, ...], in_async: bool = False) -> None:
        if name not in computations or name in seen:
            return
        top_level = name not in fused
        for instr in computations[name]:
            op = instr.opcode
            _count(cost, instr, module, times, in_async, top_level, matmul_bodies)
            if op == "while":
                loop = re.search(r"body=%([\w.-]+)", instr.attrs)
                trips = trips_of(instr, computations, by_name)
                cost.loop_trips.append(trips)
                if loop:
                    walk(loop.group(1), times * trips, (*seen, name), in_async)
                continue
            if op.endswith("-done"):
                continue
            for target in called(instr):
                walk(target, times, (*seen, name), in_async or op in ASYNC_CALLS)

    walk(module.entry, 1.0, ())
    program = schedule(module, list(cost.kernel_calls), matmul_bodies)
    return {**cost.as_dict(), "schedule": program.model_dump()}
