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
    int8: float = 0.0
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
    builder = _Builder(module, kernels, matmul_bodies)
    builder.build(module.entry)
    return builder.out


class _Builder:
    """Walks a module's computations from its entry, each once, into schedule events."""

    def __init__(self, module: Module, kernels: list[KernelKey], matmul_bodies: set[str]):
        self.computations, self.types = module.computations, module.types
        self.by_name = {i.name: i for i in module.instructions()}
        self.index = {key: k for k, key in enumerate(kernels)}
        self.matmul_bodies = matmul_bodies
        self.memo: dict[str, dict[str, float]] = {}
        self.out = Schedule(entry=module.entry)
        self.updated = {
            i.operands[0]
            for i in module.instructions()
            if i.opcode.endswith("-update") and i.operands
        }

    def flops_within(self, name: str) -> dict[str, float]:
        if name not in self.memo:
            self.memo[name] = {}
            total: dict[str, float] = defaultdict(float)
            for instr in self.computations.get(name, []):
                if instr.opcode in ("dot", "convolution"):
                    total[precision_of(instr, self.types)] += matmul_flops(instr, self.types)
                for inner in re.findall(r"\bcalls=%([\w.-]+)", instr.attrs):
                    for precision, flops in self.flops_within(inner).items():
                        total[precision] += flops
            self.memo[name] = dict(total)
        return self.memo[name]

    def work_of(self, instr: Instr) -> Work:
        """What an asynchronous or waited-for op does; for a call, what its callee does."""
        types = self.types
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
                for inner in self.computations.get(target, []):
                    if inner.opcode in ("parameter", "tuple", "get-tuple-element"):
                        continue
                    done = self.work_of(inner)
                    work.ici += done.ici
                    work.host += done.host
                    moves = not done.ici and not done.host  # else the link moves the bytes
                    work.hbm += done.hbm + (
                        op_hbm_bytes(inner, self.computations, types) if moves else 0.0
                    )
        return work

    def tensor_core_op(self, instr: Instr) -> TensorCoreOp | None:
        types = self.types
        body = callee(instr) or ""
        own = matmul_flops(instr, types)
        flops = dict(self.flops_within(body)) if instr.opcode == "fusion" else {}
        if own:
            flops[precision_of(instr, types)] = own
        key = kernel_key(instr, types)
        kernel = self.index.get(key, -1) if key else -1
        matmul = bool(own) or kernel >= 0 or body in self.matmul_bodies
        hbm = op_hbm_bytes(instr, self.computations, types)
        if not matmul and not hbm:
            return None
        return TensorCoreOp(**flops, hbm=hbm, matmul=matmul, kernel=kernel)

    def build(self, name: str) -> None:
        if name in self.out.computations or name not in self.computations:
            return
        events: list[Event] = []
        self.out.computations[name] = events
        for instr in self.computations[name]:
            for event in self.events_of(instr):
                last = events[-1] if events else None
                if (
                    isinstance(event, TensorCoreOp)
                    and not event.matmul
                    and isinstance(last, TensorCoreOp)
                    and not last.matmul
                ):
                    last.hbm += event.hbm  # HBM passes in a row are one
                else:
                    events.append(event)

    def events_of(self, instr: Instr) -> list[Event]:
        """What one instruction adds to its computation's schedule."""
        op, types = instr.opcode, self.types
        if op == "while":
            body = re.search(r"body=%([\w.-]+)", instr.attrs)
            if not body:
                return []
            self.build(body.group(1))
            trips = trips_of(instr, self.computations, self.by_name)
            return [Loop(body=body.group(1), trips=trips)]
        if op.endswith("-done"):
            return [Done(name=instr.operands[0] if instr.operands else "")]
        if op.endswith("-update"):
            # An async custom call's work runs once the update hands it its operand; the
            # done waits on the update (libtpu 0.0.52's SparseCore collectives).
            start = self.by_name.get(instr.operands[0]) if instr.operands else None
            work = self.work_of(start) if start is not None else Work()
            return [Start(name=instr.name, engine=engine_of(start or instr, types), work=work)]
        if op.endswith("-start") and instr.name in self.updated:
            return []  # started at its update
        if op.endswith("-start"):
            work = self.work_of(instr)
            engine = engine_of(instr, types)
            if engine == "async" and work.host:  # an async call that moves to or from host
                engine = "host"
            return [Start(name=instr.name, engine=engine, work=work)]
        if megascale_kind(instr):
            # A cross-slice collective: the send hands the operand to the data center
            # network, in turn with the others; its recv's result is there once the sends
            # before it are done.
            return [Start(name=instr.name, engine="dcn", work=self.work_of(instr))]
        if op == "call":
            calls: list[Event] = []
            for target in called(instr):
                self.build(target)
                calls.append(Call(callee=target))
            return calls
        if collective_op(instr, False, types) or host_bytes(instr, types):
            return [Wait(work=self.work_of(instr))]
        event = self.tensor_core_op(instr)
        return [] if event is None else [event]
