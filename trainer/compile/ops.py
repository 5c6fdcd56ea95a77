"""What one op of a compiled TPU program costs: the FLOPs of a matrix product, the HBM bytes
an op (or a fusion, whole) reads and writes, what a collective moves and how, host
transfers, a Mosaic kernel call's identity, a loop's trip count. The program's walk
(trainer/compile/cost.py) and its schedule (trainer/compile/schedule.py) both read these.
"""

from __future__ import annotations

import math
import re
from typing import NamedTuple

import numpy as np

from trainer.compile.mosaic import GROUPED_MATMULS, kernel_call
from trainer.program.hlo import (
    COLLECTIVES,
    HOST_SPACE,
    VMEM_SPACE,
    Instr,
    array_bytes,
    arrays,
    called,
    callee,
    megascale_kind,
    nbytes,
)


class CollectiveOp(NamedTuple):
    """A collective as it runs: what, over how many devices, on how many torus dimensions at
    once, on which engine (`collective`), and the bytes counted (the result of a sync
    all-gather, else the operands)."""

    kind: str
    group: int
    torus_dims: int
    engine: str
    bytes: float


class DcnOp(NamedTuple):
    """A collective between slices, over the data center network: what, over how many slices,
    and the bytes one device hands over."""

    kind: str
    group: int
    bytes: float


# The slices a cross-slice collective spans: `"{1,2,3,4}x{0:7}"` (slices 1 to 4, each device
# with its peers), or explicit groups of slice * 100000 + device, `{{100000,200000},...}`.
_MEGASCALE_TARGET = re.compile(r'_xla_megascale_target=(?:"\{([\d,]*)\}x|\{\{([\d,]*)\})')


def dcn_op(instr: Instr, types: dict[str, str]) -> DcnOp | None:
    """The cross-slice collective a megascale `send` starts (`megascale_kind`), else None."""
    kind = megascale_kind(instr) if instr.opcode == "send" else None
    if not kind:
        return None
    target = _MEGASCALE_TARGET.search(instr.attrs)
    slices = (target.group(1) or target.group(2)) if target else ""
    group = len(slices.split(",")) if slices else 1
    moved = nbytes(types.get(instr.operands[0], "")) if instr.operands else 0.0
    return DcnOp(kind, group, moved)


class KernelKey(NamedTuple):
    """A Mosaic kernel call as trainer/compile/mosaic.py reads it, and the precision its
    matmuls run in (fp8 when an operand is fp8, as in fp8 experts' grouped matmuls)."""

    name: str
    out: tuple[int, ...]
    flops: float | None
    bytes: float | None
    grid: tuple | None
    blocks: tuple | None
    tiling: tuple | None
    precision: str


_KNOWN_TRIPS = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')


def _constant(instr: Instr | None) -> int | None:
    if (
        instr is not None
        and instr.opcode == "constant"
        and re.fullmatch(r"-?\d+", instr.args.strip())
    ):
        return int(instr.args)
    return None


def _element(operand: str, local: dict[str, Instr]) -> int | None:
    """The index of the loop tuple's element an operand reads: named in place (`%p#3`), or
    through a get-tuple-element; None otherwise."""
    if "#" in operand:
        return int(operand.rsplit("#", 1)[1])
    if operand in local and local[operand].opcode == "get-tuple-element":
        found = re.search(r"index=(\d+)", local[operand].attrs)
        return int(found.group(1)) if found else None
    return None


def _counter_step(body: list[Instr], index: int | None) -> int:
    """How much a loop body adds to its counter (element `index` of the loop's tuple) each
    iteration: 1, or more where XLA unrolled the loop (a windowed einsum's ring of
    collective-permutes runs two of its steps an iteration and adds 2)."""
    if not body or index is None:
        return 1
    local = {instr.name: instr for instr in body}
    root = next((instr for instr in body if instr.root), None)
    if root is None or root.opcode != "tuple" or index >= len(root.operands):
        return 1
    update = local.get(root.operands[index])
    if update is None or update.opcode != "add":
        return 1
    reads_counter = any(_element(o, local) == index for o in update.operands)
    step = next((v for o in update.operands if (v := _constant(local.get(o))) is not None), None)
    return step if reads_counter and step and step > 0 else 1


def trip_count(condition: list[Instr], init: dict[int, Instr] | None = None,
               by_name: dict[str, Instr] | None = None,
               body: list[Instr] | None = None) -> int:  # fmt: skip
    """Iterations of a counted loop: the constant its counter is compared against (LT), less
    the counter's start when the loop's init tuple shows it (a loop XLA peeled for host
    offload starts at 1), over the step the body adds to it (`_counter_step`). `init` maps
    tuple index to the init value's instruction."""
    local = {instr.name: instr for instr in condition}
    for instr in condition:
        if instr.opcode != "compare" or "direction=LT" not in instr.attrs:
            continue
        limit = next(
            (v for o in instr.operands if (v := _constant(local.get(o))) is not None), None
        )
        if not limit:
            continue
        index = next((i for o in instr.operands if (i := _element(o, local)) is not None), None)
        value = (init or {}).get(index) if index is not None else None
        while value is not None and value.opcode == "copy" and by_name:
            value = by_name.get(value.operands[0]) if value.operands else None
        start = _constant(value) or 0
        return max(-(-(limit - start) // _counter_step(body or [], index)), 0)
    return 1


def _labels(attrs: str) -> tuple[str, str, str] | None:
    match = re.search(r"dim_labels=(\w+)_(\w+)->(\w+)", attrs)
    return (match.group(1), match.group(2), match.group(3)) if match else None


def valid_taps(
    in_size: int, out_size: int, size: int, stride: int, lhs_dil: int, rhs_dil: int, lo: int
) -> int:
    """Window taps, over every output position of one spatial dimension, that land on an
    input element: tap k of output o reads position o*stride + k*rhs_dil - lo of the input
    dilated by lhs_dil (inside it, on a multiple of lhs_dil). Counted per output position in
    closed form: the batched-dot trick's windows are as long as the tensors (n x n taps)."""
    o = np.arange(out_size, dtype=np.int64)
    start = o * stride - lo  # the position tap 0 reads
    last = (in_size - 1) * lhs_dil
    k_lo = np.maximum(0, -((start) // rhs_dil))  # ceil(-start / rhs_dil)
    k_hi = np.minimum(size - 1, (last - start) // rhs_dil)
    # k*rhs_dil = -start (mod lhs_dil): solvable where gcd(rhs_dil, lhs_dil) divides start,
    # then k = k0 (mod lhs_dil / gcd).
    g = math.gcd(rhs_dil, lhs_dil)
    m = lhs_dil // g
    inverse = pow(rhs_dil // g, -1, m) if m > 1 else 0
    solvable = (-start) % g == 0
    k0 = ((-start) // g * inverse) % m
    count = (k_hi - k0) // m - (k_lo - 1 - k0) // m
    return int(np.where(solvable & (k_hi >= k_lo), count, 0).sum())


def conv_flops(instr: Instr, types: dict[str, str]) -> float:
    """Multiply-adds x 2 of a convolution, counting only window taps that land inside the
    (dilated) input: the batched-dot window trick (size n, pad n-1) then costs one dot."""
    labels = _labels(instr.attrs)
    if not labels or len(instr.operands) < 2:
        return 0.0
    lhs_l, rhs_l, out_l = labels
    (_, lhs, _), (_, rhs, _), (_, out, _) = (arrays(types.get(o, ""))[0] for o in
                                             (*instr.operands[:2], instr.name))  # fmt: skip
    window = re.search(r"window=\{([^}]*)\}", instr.attrs)
    spec = window.group(1) if window else ""

    def field_of(key: str, n: int, default: int) -> list[int]:
        match = re.search(rf"{key}=([\dx_]+)", spec)
        if not match:
            return [default] * n
        parts = match.group(1).split("x")
        return [int(p.split("_")[0]) for p in parts] if key != "pad" else parts  # type: ignore[return-value]

    spatial = [c for c in out_l if c.isdigit()]
    n = len(spatial)
    sizes = field_of("size", n, 1)
    strides = field_of("stride", n, 1)
    lhs_dil = field_of("lhs_dilate", n, 1)
    rhs_dil = field_of("rhs_dilate", n, 1)
    pads = field_of("pad", n, 0)
    taps = 1
    for i, d in enumerate(spatial):
        in_size, out_size = lhs[lhs_l.index(d)], out[out_l.index(d)]
        lo = int(str(pads[i]).split("_")[0]) if isinstance(pads[i], str) else 0
        taps *= valid_taps(in_size, out_size, sizes[i], strides[i], lhs_dil[i], rhs_dil[i], lo)
    non_spatial = math.prod(out[j] for j, c in enumerate(out_l) if not c.isdigit())
    return 2.0 * non_spatial * rhs[rhs_l.index("i")] * taps


def matmul_flops(instr: Instr, types: dict[str, str]) -> float:
    """FLOPs of a dot or convolution op; 0 for any other op."""
    if instr.opcode == "dot":
        return dot_flops(instr, types)
    return conv_flops(instr, types) if instr.opcode == "convolution" else 0.0


def dot_flops(instr: Instr, types: dict[str, str]) -> float:
    out = arrays(instr.type)[0][1]
    lhs = arrays(types.get(instr.operands[0], ""))[0][1]
    match = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", instr.attrs)
    contracted = [int(d) for d in match.group(1).split(",") if d] if match else []
    return 2.0 * math.prod(out) * math.prod(lhs[d] for d in contracted)


def precision_of(instr: Instr, types: dict[str, str]) -> str:
    """The rate a matrix product runs at: fp8 with an fp8 operand, int8 with both operands
    8-bit integers (the MXU's integer mode), bf16, else f32."""
    kinds = {arrays(types.get(o, ""))[0][0] for o in instr.operands[:2] if arrays(types.get(o, ""))}
    if any(k.startswith("f8") for k in kinds):
        return "fp8"
    if kinds and kinds <= {"s8", "u8"}:
        return "int8"
    return "bf16" if "bf16" in kinds else "f32"


def group_size(attrs: str) -> int:
    mesh = re.search(r"replica_groups=mesh\[([^\]]*)\] \{([^}]*)\}", attrs)
    if mesh:
        sizes = dict(re.findall(r"'(\w+)'=(\d+)", mesh.group(1)))
        return math.prod(int(sizes[a]) for a in re.findall(r"'(\w+)'", mesh.group(2)))
    groups = re.search(r"replica_groups=\{\{([\d,]*)\}", attrs)
    if groups:
        return len(groups.group(1).split(","))
    iota = re.search(r"replica_groups=\[\d+,(\d+)\]", attrs)
    return int(iota.group(1)) if iota else 1


_PASS_THROUGH = ("bitcast", "copy", "reshape")  # in a fusion: the same bytes, relaid


_SPARSECORE = '"device_type":"DEVICE_TYPE_SPARSECORE"'


def collective(instr: Instr, in_async_call: bool) -> tuple[int, str]:
    """How a collective runs, from libtpu's backend config: the torus dimensions its rings
    use at once (colors rotating over X, Y and Z: 3; one ring threaded through the slice,
    as a single-SparseCore reduce-scatter: 1; no config, as on CPU: 1), and its engine:
    `sparsecore` (offloaded to the SparseCores, beside the TensorCore), `async` (a
    -start/-done pair, or inside a computation called asynchronously) or `sync` (the
    TensorCore waits; XLA turns an async pair with nothing to overlap back into this)."""
    active = re.search(r"active_dims:([01]+)", instr.attrs)
    # libtpu 0.0.42 names a ring's dimension "ring_dim":"ICI_RING_DIM_X_MESH"; 0.0.52 (MaxText
    # 0.2.5's) "explicit_strategy_ring_dim":"ICI_RING_DIM_X_TORUS".
    rings = set(re.findall(r'ring_dim":"ICI_RING_DIM_([XYZ])_(?:MESH|TORUS)"', instr.attrs))
    dims = active.group(1).count("1") if active else len(rings)
    if _SPARSECORE in instr.attrs:
        engine = "sparsecore"
    elif in_async_call or instr.opcode.endswith("-start"):
        engine = "async"
    else:
        engine = "sync"
    return max(dims, 1), engine


def _bytes_read(value: str, body: list[Instr], computations: dict[str, list[Instr]],
                types: dict[str, str], depth: int = 0) -> float:  # fmt: skip
    """HBM bytes a fusion reads of one of its inputs: a stacked buffer it only slices
    (dynamic-slice) costs the slices, one it updates in place (dynamic-update-slice)
    costs nothing to read; a gather reads the rows it fetches, once per index (more than
    the buffer where rows repeat: top-k routing fetches each token's row k times); anything
    else reads it whole."""
    whole = nbytes(types.get(value, ""), VMEM_SPACE)
    if depth > 8:
        return whole
    users = [i for i in body if value in i.operands]
    gathers = [u for u in users if u.opcode == "gather" and u.operands[0] == value]
    gathered = sum(nbytes(u.type) for u in gathers)
    read = 0.0
    for user in (u for u in users if u not in gathers):
        if user.opcode == "dynamic-slice" and user.operands[0] == value:
            read += nbytes(user.type)
        elif user.opcode == "dynamic-update-slice" and user.operands[0] == value:
            continue
        elif user.opcode in _PASS_THROUGH or (
            user.opcode == "fusion" and "output_to_operand_aliasing" in user.attrs
        ):
            if user.opcode == "fusion":
                inner = computations.get(callee(user) or "", [])
                params = [i for i in inner if i.opcode == "parameter"]
                if len(params) != 1 or not any(
                    i.opcode in _PASS_THROUGH or i.opcode == "fusion" for i in inner
                ):
                    return whole + gathered
            read += _bytes_read(user.name, body, computations, types, depth + 1)
        elif user.opcode == "fusion":
            inner = computations.get(callee(user) or "", [])
            index = user.operands.index(value)
            param = next((i.name for i in inner if i.opcode == "parameter"
                          and i.args.strip() == str(index)), None)  # fmt: skip
            if param is None:
                return whole + gathered
            read += _bytes_read(param, inner, computations, types, depth + 1)
        else:
            return whole + gathered
    return min(read, whole) + gathered


def _bytes_written(instr: Instr, by_name: dict[str, Instr], depth: int = 0) -> float:
    """HBM bytes a fusion's root writes: an in-place dynamic-update-slice writes its update."""
    if depth > 8:
        return nbytes(instr.type, VMEM_SPACE)
    if instr.opcode == "tuple":
        return sum(_bytes_written(by_name[o], by_name, depth + 1) for o in instr.operands
                   if o in by_name)  # fmt: skip
    if instr.opcode == "dynamic-update-slice" and len(instr.operands) > 1:
        update = by_name.get(instr.operands[1])
        return nbytes(update.type, VMEM_SPACE) if update else nbytes(instr.type, VMEM_SPACE)
    if instr.opcode in _PASS_THROUGH and instr.operands and instr.operands[0] in by_name:
        inner = by_name[instr.operands[0]]
        if inner.opcode != "parameter":
            return _bytes_written(inner, by_name, depth + 1)
    return nbytes(instr.type, VMEM_SPACE)


def fusion_hbm_bytes(instr: Instr, computations: dict[str, list[Instr]],
                     types: dict[str, str]) -> float:  # fmt: skip
    """HBM bytes one fusion moves: what it reads of each input and what it writes, where a
    layer's slice of a stacked (scanned) buffer costs the slice, not the stack."""
    body = computations.get(callee(instr) or "", [])
    params = {i.args.strip(): i.name for i in body if i.opcode == "parameter"}
    root = next((i for i in reversed(body) if i.root), body[-1] if body else None)
    if root is None:
        operands = sum(nbytes(types.get(o, ""), VMEM_SPACE) for o in instr.operands)
        return operands + nbytes(instr.type, VMEM_SPACE)
    read = 0.0
    for index, operand in enumerate(instr.operands):
        whole = nbytes(types.get(operand, ""), VMEM_SPACE)
        param = params.get(str(index))
        # At most the whole input, and the rows a gather fetches (_bytes_read).
        read += whole if param is None else _bytes_read(param, body, computations, types)
    by_name = {i.name: i for i in body}
    return read + min(_bytes_written(root, by_name), nbytes(instr.type, VMEM_SPACE))


def with_matmuls(computations: dict[str, list[Instr]]) -> set[str]:
    """Computations that hold a dot or convolution, directly or in a fusion they call."""
    found = {name for name, body in computations.items()
             if any(i.opcode in ("dot", "convolution") for i in body)}  # fmt: skip
    grew = True
    while grew:
        callers = {name for name, body in computations.items() if name not in found
                   and any(callee(i) in found for i in body if i.opcode == "fusion")}  # fmt: skip
        found |= callers
        grew = bool(callers)
    return found


def host_bytes(instr: Instr, types: dict[str, str]) -> float:
    """Bytes one op moves between device and host memory (`S(5)`). Offloaded residuals of a
    scanned layer go out as a dynamic-update-slice(-start) of one layer into the stacked host
    buffer and come back as a dynamic-slice(-start) of one layer: the slice moves, not the
    buffer. Copies (and fusions) to or from host move their whole value."""
    op = instr.opcode.removesuffix("-start")
    operand_types = [types.get(o, "") for o in instr.operands]
    if not any(HOST_SPACE in t for t in (instr.type, *operand_types)):
        return 0.0
    if op == "dynamic-update-slice" and len(operand_types) > 1:
        return nbytes(operand_types[1])
    if op == "dynamic-slice":
        # -start: ((operands), slice, context); the slice is the largest array off the host
        return max((array_bytes(dtype, dims) for dtype, dims, layout in arrays(instr.type)
                    if HOST_SPACE not in layout), default=0.0)  # fmt: skip
    if op in ("copy", "fusion"):
        return nbytes(instr.type, HOST_SPACE) or nbytes(instr.type)
    return 0.0


def trips_of(instr: Instr, computations: dict[str, list[Instr]], by_name: dict[str, Instr]) -> int:
    """Iterations of a `while` op (its condition's bound, less its counter's start)."""
    cond = re.search(r"condition=%([\w.-]+)", instr.attrs)
    counted = 1
    if cond:
        init = by_name.get(instr.operands[0]) if instr.operands else None
        elements = (
            {k: by_name[o] for k, o in enumerate(init.operands) if o in by_name}
            if init is not None and init.opcode == "tuple"
            else {}
        )
        body = re.search(r"body=%([\w.-]+)", instr.attrs)
        counted = trip_count(
            computations.get(cond.group(1), []),
            elements,
            by_name,
            computations.get(body.group(1), []) if body else None,
        )
    # XLA:GPU fuses the condition's compare away; it states the count it proved instead.
    known = _KNOWN_TRIPS.search(instr.attrs)
    return int(known.group(1)) if counted == 1 and known else counted


def collective_op(instr: Instr, in_async: bool, types: dict[str, str]) -> CollectiveOp | None:
    """The collective an op runs, else None."""
    op = instr.opcode
    kind = next((k for k in COLLECTIVES if op in (k, f"{k}-start")), None)
    if not kind:
        return None
    operand_bytes = sum(nbytes(types.get(o, "")) for o in instr.operands)
    moved = nbytes(instr.type) if kind == "all-gather" and op == kind else operand_bytes
    return CollectiveOp(kind, group_size(instr.attrs), *collective(instr, in_async), moved)


# Top-level ops that move no data of their own: structure, control flow, async halves
# (their work is costed where they start), and collectives (costed on the interconnect).
_NO_DATA = {"parameter", "get-tuple-element", "tuple", "bitcast", "constant", "while",
            "call", "conditional", "after-all", "partition-id", "replica-id", "opt-barrier",
            "add-dependency", "domain", "send", "recv", "send-done", "recv-done"}  # fmt: skip


def op_hbm_bytes(instr: Instr, computations: dict[str, list[Instr]],
                  types: dict[str, str]) -> float:  # fmt: skip
    """HBM bytes a top-level op reads and writes (VMEM-resident values excluded): a fusion
    what it reads and writes (`fusion_hbm_bytes`); an in-place dynamic-update-slice its
    update, read and written; a slice what it takes, read and written; any other op that
    computes (a matmul, a copy, a kernel, an unfused elementwise op, reduce, sort, ...) its
    operands and its output, once (a sort's passes over its data are not counted)."""
    op = instr.opcode
    if op == "fusion":
        return fusion_hbm_bytes(instr, computations, types)
    if (op in _NO_DATA or op.endswith(("-start", "-update", "-done"))
            or op in COLLECTIVES):  # fmt: skip
        return 0.0
    if op == "custom-call" and called(instr):
        return 0.0  # a wrapper (a SparseCore call's): its callee's ops move the bytes
    if op == "dynamic-update-slice" and len(instr.operands) > 1:
        return 2 * nbytes(types.get(instr.operands[1], ""), VMEM_SPACE)
    if op in ("dynamic-slice", "slice"):
        return 2 * nbytes(instr.type, VMEM_SPACE)
    operands = sum(nbytes(types.get(o, ""), VMEM_SPACE) for o in instr.operands)
    return operands + nbytes(instr.type, VMEM_SPACE)


def kernel_key(instr: Instr, types: dict[str, str]) -> KernelKey | None:
    """The Mosaic kernel call an op is, else None."""
    if instr.opcode != "custom-call":
        return None
    kernel = kernel_call(instr.name, instr.attrs)
    if not kernel:
        return None
    out = next((tuple(dims) for _, dims, _ in arrays(instr.type)), ())
    fp8 = any(d.startswith("f8") for o in instr.operands for d, _, _ in arrays(types.get(o, "")))
    flops = kernel["flops"]
    if flops is None and kernel["name"].startswith(GROUPED_MATMULS):
        flops = _grouped_flops(instr, types, out)
    return KernelKey(
        name=kernel["name"],
        out=out,
        flops=flops,
        bytes=kernel["bytes"],
        grid=kernel["grid"],
        blocks=kernel["blocks"],
        tiling=kernel["tiling"],
        precision="fp8" if fp8 else "bf16",
    )


def _grouped_flops(instr: Instr, types: dict[str, str], out: tuple[int, ...]) -> float | None:
    """2mkn of a grouped-matmul call read from its shapes, for a kernel whose config carries no
    cost estimate (jax 0.12's Mosaic calls: tokamax 0.0.17 in MaxText 0.2.5). Its operands are
    the group metadata (integers), then the rows [m, k] (gmm) or [m, k] and [m, n] (tgmm),
    then the weights; gmm's result is [m, n], tgmm's [groups, k, n]."""
    rows = next(
        (dims for o in instr.operands for dtype, dims, _ in arrays(types.get(o, ""))[:1]
         if len(dims) == 2 and not dtype.startswith(("s", "u", "pred"))),
        None,
    )  # fmt: skip
    if rows is None or len(out) not in (2, 3):
        return None
    m, k, n = (out[0], rows[1], out[1]) if len(out) == 2 else (rows[0], out[1], out[2])
    return 2.0 * m * k * n


def engine_of(instr: Instr, types: dict[str, str]) -> str:
    """The unit an asynchronous op runs on: the SparseCores (an async call on their thread),
    the interconnect (a collective), the host link (a transfer to or from the host)."""
    thread = re.search(r'async_execution_thread="(\w+)"', instr.attrs)
    if thread and thread.group(1) != "main":
        return thread.group(1)
    if collective_op(instr, True, types):
        return "ici"
    return "host" if host_bytes(instr, types) else "async"
