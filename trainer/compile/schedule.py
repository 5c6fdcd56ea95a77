"""A compiled program as the TensorCore runs it: for each computation it runs (the entry,
loop bodies, called computations), its ops in their scheduled order as typed events, read
from the optimized HLO. The step-time model (trainer/compile/step_model.py) runs them.
"""

from __future__ import annotations

import re
from collections import defaultdict
from typing import Annotated, Literal

from pydantic import BaseModel, Field

from trainer.compile.ops import (
    KernelKey,
    collective_op,
    dcn_op,
    engine_of,
    host_bytes,
    kernel_key,
    matmul_flops,
    op_hbm_bytes,
    precision_of,
    trips_of,
)
from trainer.program.hlo import (
    ASYNC_CALLS,
    Instr,
    Module,
    called,
    callee,
    megascale_kind,
    nbytes,
)


class Ring(BaseModel):
    """A collective's traffic: its kind, group size, torus dimensions its rings use at once,
    and the bytes counted."""

    kind: str
    group: int
    torus_dims: int
    bytes: float


class Work(BaseModel):
    """What an asynchronous or waited-for op does: the collectives it runs, the HBM bytes of
    the ops it runs, its host transfer bytes, and its collectives between slices."""

    ici: list[Ring] = Field(default_factory=list)
    hbm: float = 0.0
    host: float = 0.0
    dcn: list[Ring] = Field(default_factory=list)  # between slices (torus_dims unused: 1)


class TensorCoreOp(BaseModel):
    """An op the TensorCore runs: its matrix FLOPs by precision, HBM bytes, whether it holds
    a matrix product, and the index of its Mosaic kernel call in the cost's `kernel_calls`
    (-1: none). Neighbouring ops without matmuls are one event."""

    op: Literal["tc"] = "tc"
    fp8: float = 0.0
    bf16: float = 0.0
    f32: float = 0.0
    hbm: float = 0.0
    matmul: bool = False
    kernel: int = -1


class Start(BaseModel):
    """An asynchronous op begins (a `-start`: a collective, a host copy, a call to the
    SparseCores) on `engine` (`sparsecore`, `ici`, `host`, `async`)."""

    op: Literal["start"] = "start"
    name: str
    engine: str
    work: Work


class Done(BaseModel):
    """The TensorCore waits for the op `name` started."""

    op: Literal["done"] = "done"
    name: str


class Wait(BaseModel):
    """An op the TensorCore runs and waits for (a synchronous collective, a transfer to or
    from the host)."""

    op: Literal["wait"] = "wait"
    work: Work


class Loop(BaseModel):
    op: Literal["loop"] = "loop"
    body: str
    trips: int


class Call(BaseModel):
    op: Literal["call"] = "call"
    callee: str


Event = Annotated[TensorCoreOp | Start | Done | Wait | Loop | Call, Field(discriminator="op")]


class Schedule(BaseModel):
    entry: str
    computations: dict[str, list[Event]] = Field(default_factory=dict)


def schedule(module: Module, kernels: list[KernelKey], matmul_bodies: set[str]) -> Schedule:
    """The program's schedule. `kernels` are the cost's kernel calls in their order (a
    `TensorCoreOp.kernel` indexes them); `matmul_bodies` the computations that hold a matrix
    product (`ops.with_matmuls`)."""
    computations, types = module.computations, module.types
    by_name = {i.name: i for i in module.instructions()}
    index = {key: k for k, key in enumerate(kernels)}
    memo: dict[str, dict[str, float]] = {}
    out = Schedule(entry=module.entry)
    updated = {
        i.operands[0] for i in module.instructions() if i.opcode.endswith("-update") and i.operands
    }

    def flops_within(name: str) -> dict[str, float]:
        if name not in memo:
            memo[name] = {}
            total: dict[str, float] = defaultdict(float)
            for instr in computations.get(name, []):
                if instr.opcode in ("dot", "convolution"):
                    total[precision_of(instr, types)] += matmul_flops(instr, types)
                for inner in re.findall(r"\bcalls=%([\w.-]+)", instr.attrs):
                    for precision, flops in flops_within(inner).items():
                        total[precision] += flops
            memo[name] = dict(total)
        return memo[name]

    def work_of(instr: Instr) -> Work:
        """What an asynchronous or waited-for op does; for a call, what its callee does."""
        work = Work(host=host_bytes(instr, types))
        found = collective_op(instr, True, types)
        if found:
            work.ici.append(Ring(kind=found.kind, group=found.group,
                                 torus_dims=found.torus_dims, bytes=found.bytes))  # fmt: skip
        between = dcn_op(instr, types)
        if between:
            work.dcn.append(Ring(kind=between.kind, group=between.group, torus_dims=1,
                                 bytes=between.bytes))  # fmt: skip
        if instr.opcode == "copy-start" and not work.host:
            work.hbm += 2 * sum(nbytes(types.get(o, "")) for o in instr.operands)
        # An async call runs its callee; inside, a call or a custom call may run its own
        # (MaxText's programs wrap a SparseCore collective or copy in more such calls).
        if instr.opcode in (*ASYNC_CALLS, "call", "custom-call"):
            for target in called(instr):
                for inner in computations.get(target, []):
                    if inner.opcode in ("parameter", "tuple", "get-tuple-element"):
                        continue
                    done = work_of(inner)
                    work.ici += done.ici
                    work.host += done.host
                    moves = not done.ici and not done.host  # else the link moves the bytes
                    work.hbm += done.hbm + (
                        op_hbm_bytes(inner, computations, types) if moves else 0.0
                    )
        return work

    def tensor_core_op(instr: Instr) -> TensorCoreOp | None:
        body = callee(instr) or ""
        own = matmul_flops(instr, types)
        flops = dict(flops_within(body)) if instr.opcode == "fusion" else {}
        if own:
            flops[precision_of(instr, types)] = own
        key = kernel_key(instr, types)
        kernel = index.get(key, -1) if key else -1
        matmul = bool(own) or kernel >= 0 or body in matmul_bodies
        hbm = op_hbm_bytes(instr, computations, types)
        if not matmul and not hbm:
            return None
        return TensorCoreOp(**flops, hbm=hbm, matmul=matmul, kernel=kernel)

    def build(name: str) -> None:
        if name in out.computations or name not in computations:
            return
        events: list = []
        out.computations[name] = events
        for instr in computations[name]:
            op = instr.opcode
            if op == "while":
                body = re.search(r"body=%([\w.-]+)", instr.attrs)
                if body:
                    build(body.group(1))
                    trips = trips_of(instr, computations, by_name)
                    events.append(Loop(body=body.group(1), trips=trips))
            elif op.endswith("-done"):
                events.append(Done(name=instr.operands[0] if instr.operands else ""))
            elif op.endswith("-update"):
                # An async custom call's work runs once the update hands it its operand; the
                # done waits on the update (libtpu 0.0.52's SparseCore collectives).
                start = by_name.get(instr.operands[0]) if instr.operands else None
                work = work_of(start) if start is not None else Work()
                events.append(Start(name=instr.name, engine=engine_of(start or instr, types),
                                    work=work))  # fmt: skip
            elif op.endswith("-start") and instr.name in updated:
                continue  # started at its update
            elif op.endswith("-start"):
                work = work_of(instr)
                engine = engine_of(instr, types)
                if engine == "async" and work.host:  # an async call that moves to or from host
                    engine = "host"
                events.append(Start(name=instr.name, engine=engine, work=work))
            elif megascale_kind(instr):
                # A cross-slice collective: the send hands the operand to the data center
                # network, in turn with the others; its recv's result is there once the
                # sends before it are done.
                events.append(Start(name=instr.name, engine="dcn", work=work_of(instr)))
            elif op == "call":
                for target in called(instr):
                    build(target)
                    events.append(Call(callee=target))
            elif collective_op(instr, False, types) or host_bytes(instr, types):
                events.append(Wait(work=work_of(instr)))
            elif (event := tensor_core_op(instr)) is not None:
                last = events[-1] if events else None
                if not event.matmul and isinstance(last, TensorCoreOp) and not last.matmul:
                    last.hbm += event.hbm
                else:
                    events.append(event)

    build(module.entry)
    return out
