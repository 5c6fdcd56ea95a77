"""What a compiled program does per step, read from its optimized HLO (fidelity: compile).

XLA's own cost analysis counts a scanned layer once; this walk multiplies every op by the
trip counts of the loops around it. It reads TPU HLO as libtpu prints it: operands by name
(their shapes from their definitions), matrix products as `convolution`s with
`dim_labels` (the batched-dot window trick included), loop bounds in the condition.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np

from trainer.compile.mosaic import kernel_call
from trainer.program.hlo import COLLECTIVES

BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "bf16": 2, "f16": 2,
         "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8}  # fmt: skip
_ARRAY = re.compile(r"\b(pred|[suf]\d+|bf16|f8e\w+)\[([\d,]*)\](\{[^}]*\})?")
_HEADER = re.compile(r"^(ENTRY )?%([\w.-]+) \((.*)\) -> .* \{$")
_INSTR = re.compile(r"^\s*(ROOT )?%([\w.-]+) = (.+?) ([\w-]+)\((.*?)\)(.*)$")
_PARAM = re.compile(r"([\w.-]+): ((?:\([^)]*\))|[^,]+(?:\[[^\]]*\])?)")
_KNOWN_TRIPS = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_CALLEES = re.compile(r"\b(calls|body|to_apply)=%([\w.-]+)")
HOST_SPACE = "S(5)"  # TPU memory space 5: pinned host memory


@dataclass
class Instr:
    name: str
    type: str
    opcode: str
    operands: list[str]
    attrs: str
    args: str = ""  # the text between the parentheses (a constant's value)
    root: bool = False


@dataclass
class Cost:
    """Per device, per step (loops unrolled by trip count)."""

    flops: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    hbm_bytes: float = 0.0
    hbm_bytes_without_matmul: float = 0.0  # of ops with no matrix product: never under the MXU
    collective_bytes: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    collective_group_sizes: dict[str, set] = field(default_factory=lambda: defaultdict(set))
    # bytes by (kind, group size, torus dims its rings use at once, engine): see `collective`
    collective_ops: dict[tuple, float] = field(default_factory=lambda: defaultdict(float))
    host_transfer_bytes: float = 0.0
    custom_calls: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    # Mosaic kernel calls by (name, output dims, cost-estimate FLOPs and bytes, grid, blocks,
    # tiling, precision)
    kernel_calls: dict[tuple, float] = field(default_factory=lambda: defaultdict(float))
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
            "host_transfer_bytes": self.host_transfer_bytes,
            "custom_calls": dict(self.custom_calls),
            "kernel_calls": [
                dict(
                    name=n,
                    out=list(o),
                    flops=f,
                    bytes=b,
                    grid=g,
                    blocks=k,
                    tiling=m,
                    precision=p,
                    times=t,
                )
                for (n, o, f, b, g, k, m, p), t in self.kernel_calls.items()
            ],
            "loop_trips": self.loop_trips,
        }


def arrays(type_str: str) -> list[tuple[str, list[int], str]]:
    """(dtype, dims, layout) of each array in a (possibly tuple) HLO type."""
    return [
        (dtype, [int(d) for d in dims.split(",") if d], layout or "")
        for dtype, dims, layout in _ARRAY.findall(type_str)
    ]


def _array_bytes(dtype: str, dims: list[int]) -> float:
    return math.prod(dims) * (1 if dtype.startswith("f8") else BYTES.get(dtype, 4))


def nbytes(type_str: str, skip_space: str | None = None) -> float:
    return sum(
        _array_bytes(dtype, dims)
        for dtype, dims, layout in arrays(type_str)
        if not (skip_space and skip_space in layout)
    )


def parse(hlo_text: str) -> tuple[dict[str, list[Instr]], str, dict[str, str]]:
    """Computations by name, the entry's name, and every value's type by name."""
    computations: dict[str, list[Instr]] = {}
    types: dict[str, str] = {}
    entry, current = "", None
    for line in hlo_text.splitlines():
        header = _HEADER.match(line)
        if header:
            current = header.group(2)
            computations[current] = []
            entry = current if header.group(1) else entry
            for pname, ptype in _PARAM.findall(header.group(3)):
                types[pname] = ptype
            continue
        if current is None:
            continue
        if line == "}":
            current = None
            continue
        match = _INSTR.match(line)
        if match:
            root, name, type_str, opcode, operands, attrs = match.groups()
            names = re.findall(r"%([\w.-]+(?:#\d+)?)", operands)
            instr = Instr(name, type_str, opcode, names, attrs, operands, bool(root))
            computations[current].append(instr)
            types[name] = type_str
        elif computations[current]:  # an attribute with a line break (a kernel's metadata)
            computations[current][-1].attrs += "\n" + line
    # Newer HLO names a tuple's element in place (`%param.0#3`): its type is that element's.
    for ref in {o for instrs in computations.values() for i in instrs for o in i.operands}:
        if "#" in ref:
            name, index = ref.rsplit("#", 1)
            elements = tuple_elements(types.get(name, ""))
            types[ref] = elements[int(index)] if int(index) < len(elements) else ""
    return computations, entry, types


def tuple_elements(type_str: str) -> list[str]:
    """The top-level element types of a tuple type (one element for an array type)."""
    text = re.sub(r"/\*.*?\*/", "", type_str.strip())
    if not text.startswith("("):
        return [text]
    elements, depth, start = [], 0, 1
    for pos, char in enumerate(text[1:-1], start=1):
        depth += (char in "([{") - (char in ")]}")
        if char == "," and depth == 0:
            elements.append(text[start:pos].strip())
            start = pos + 1
    return [*elements, text[start:-1].strip()]


def _constant(instr: Instr | None) -> int | None:
    if (
        instr is not None
        and instr.opcode == "constant"
        and re.fullmatch(r"-?\d+", instr.args.strip())
    ):
        return int(instr.args)
    return None


def trip_count(condition: list[Instr], init: dict[int, Instr] | None = None,
               by_name: dict[str, Instr] | None = None) -> int:  # fmt: skip
    """Iterations of a counted loop: the constant its counter is compared against (LT), less
    the counter's start when the loop's init tuple shows it (a loop XLA peeled for host
    offload starts at 1). `init` maps tuple index to the init value's instruction."""
    local = {instr.name: instr for instr in condition}
    for instr in condition:
        if instr.opcode != "compare" or "direction=LT" not in instr.attrs:
            continue
        limit = next(
            (v for o in instr.operands if (v := _constant(local.get(o))) is not None), None
        )
        if not limit:
            continue
        index = None
        for operand in instr.operands:
            if "#" in operand:  # the loop parameter's element, named in place
                index = int(operand.rsplit("#", 1)[1])
            elif operand in local and local[operand].opcode == "get-tuple-element":
                found = re.search(r"index=(\d+)", local[operand].attrs)
                index = int(found.group(1)) if found else None
        value = (init or {}).get(index) if index is not None else None
        while value is not None and value.opcode == "copy" and by_name:
            value = by_name.get(value.operands[0]) if value.operands else None
        start = _constant(value) or 0
        return max(limit - start, 0)
    return 1


def _labels(attrs: str) -> tuple[str, str, str] | None:
    match = re.search(r"dim_labels=(\w+)_(\w+)->(\w+)", attrs)
    return match.groups() if match else None


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


def _precision(instr: Instr, types: dict[str, str]) -> str:
    kinds = {arrays(types.get(o, ""))[0][0] for o in instr.operands[:2] if arrays(types.get(o, ""))}
    return (
        "fp8" if any(k.startswith("f8") for k in kinds) else ("bf16" if "bf16" in kinds else "f32")
    )


def _group_size(attrs: str) -> int:
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


_ASYNC_CALLS = ("call-start", "async-start")
_SPARSECORE = '"device_type":"DEVICE_TYPE_SPARSECORE"'


def collective(instr: Instr, in_async_call: bool) -> tuple[int, str]:
    """How a collective runs, from libtpu's backend config: the torus dimensions its rings
    use at once (colors rotating over X, Y and Z: 3; one ring threaded through the slice,
    as a single-SparseCore reduce-scatter: 1; no config, as on CPU: 1), and its engine:
    `sparsecore` (offloaded to the SparseCores, beside the TensorCore), `async` (a
    -start/-done pair, or inside a computation called asynchronously) or `sync` (the
    TensorCore waits; XLA turns an async pair with nothing to overlap back into this)."""
    active = re.search(r"active_dims:([01]+)", instr.attrs)
    rings = set(re.findall(r'"ring_dim":"ICI_RING_DIM_(\w+?)_MESH"', instr.attrs))
    dims = active.group(1).count("1") if active else len(rings)
    if _SPARSECORE in instr.attrs:
        engine = "sparsecore"
    elif in_async_call or instr.opcode.endswith("-start"):
        engine = "async"
    else:
        engine = "sync"
    return max(dims, 1), engine


def _callee(instr: Instr) -> str | None:
    found = re.search(r"calls=%([\w.-]+)", instr.attrs)
    return found.group(1) if found else None


def _bytes_read(value: str, body: list[Instr], computations: dict[str, list[Instr]],
                types: dict[str, str], depth: int = 0) -> float:  # fmt: skip
    """HBM bytes a fusion reads of one of its inputs: a stacked buffer it only slices
    (dynamic-slice) costs the slices, one it updates in place (dynamic-update-slice)
    costs nothing to read; anything else reads it whole."""
    whole = nbytes(types.get(value, ""), "S(1)")
    if depth > 8:
        return whole
    read = 0.0
    for user in (i for i in body if value in i.operands):
        if user.opcode == "dynamic-slice" and user.operands[0] == value:
            read += nbytes(user.type)
        elif user.opcode == "dynamic-update-slice" and user.operands[0] == value:
            continue
        elif user.opcode in _PASS_THROUGH or (
            user.opcode == "fusion" and "output_to_operand_aliasing" in user.attrs
        ):
            if user.opcode == "fusion":
                inner = computations.get(_callee(user) or "", [])
                params = [i for i in inner if i.opcode == "parameter"]
                if len(params) != 1 or not any(
                    i.opcode in _PASS_THROUGH or i.opcode == "fusion" for i in inner
                ):
                    return whole
            read += _bytes_read(user.name, body, computations, types, depth + 1)
        elif user.opcode == "fusion":
            inner = computations.get(_callee(user) or "", [])
            index = user.operands.index(value)
            param = next((i.name for i in inner if i.opcode == "parameter"
                          and i.args.strip() == str(index)), None)  # fmt: skip
            if param is None:
                return whole
            read += _bytes_read(param, inner, computations, types, depth + 1)
        else:
            return whole
    return min(read, whole)


def _bytes_written(instr: Instr, by_name: dict[str, Instr], depth: int = 0) -> float:
    """HBM bytes a fusion's root writes: an in-place dynamic-update-slice writes its update."""
    if depth > 8:
        return nbytes(instr.type, "S(1)")
    if instr.opcode == "tuple":
        return sum(_bytes_written(by_name[o], by_name, depth + 1) for o in instr.operands
                   if o in by_name)  # fmt: skip
    if instr.opcode == "dynamic-update-slice" and len(instr.operands) > 1:
        update = by_name.get(instr.operands[1])
        return nbytes(update.type, "S(1)") if update else nbytes(instr.type, "S(1)")
    if instr.opcode in _PASS_THROUGH and instr.operands and instr.operands[0] in by_name:
        inner = by_name[instr.operands[0]]
        if inner.opcode != "parameter":
            return _bytes_written(inner, by_name, depth + 1)
    return nbytes(instr.type, "S(1)")


def fusion_hbm_bytes(instr: Instr, computations: dict[str, list[Instr]],
                     types: dict[str, str]) -> float:  # fmt: skip
    """HBM bytes one fusion moves: what it reads of each input and what it writes, where a
    layer's slice of a stacked (scanned) buffer costs the slice, not the stack."""
    body = computations.get(_callee(instr) or "", [])
    params = {i.args.strip(): i.name for i in body if i.opcode == "parameter"}
    root = next((i for i in reversed(body) if i.root), body[-1] if body else None)
    if root is None:
        operands = sum(nbytes(types.get(o, ""), "S(1)") for o in instr.operands)
        return operands + nbytes(instr.type, "S(1)")
    read = 0.0
    for index, operand in enumerate(instr.operands):
        whole = nbytes(types.get(operand, ""), "S(1)")
        param = params.get(str(index))
        read += whole if param is None else min(whole, _bytes_read(param, body, computations,
                                                                   types))  # fmt: skip
    by_name = {i.name: i for i in body}
    return read + min(_bytes_written(root, by_name), nbytes(instr.type, "S(1)"))


def _with_matmuls(computations: dict[str, list[Instr]]) -> set[str]:
    """Computations that hold a dot or convolution, directly or in a fusion they call."""
    found = {name for name, body in computations.items()
             if any(i.opcode in ("dot", "convolution") for i in body)}  # fmt: skip
    grew = True
    while grew:
        callers = {name for name, body in computations.items() if name not in found
                   and any(_callee(i) in found for i in body if i.opcode == "fusion")}  # fmt: skip
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
        return max((_array_bytes(dtype, dims) for dtype, dims, layout in arrays(instr.type)
                    if HOST_SPACE not in layout), default=0.0)  # fmt: skip
    if op in ("copy", "fusion"):
        return nbytes(instr.type, HOST_SPACE) or nbytes(instr.type)
    return 0.0


def _trips(instr: Instr, computations: dict[str, list[Instr]], by_name: dict[str, Instr]) -> int:
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
        counted = trip_count(computations.get(cond.group(1), []), elements, by_name)
    # XLA:GPU fuses the condition's compare away; it states the count it proved instead.
    known = _KNOWN_TRIPS.search(instr.attrs)
    return int(known.group(1)) if counted == 1 and known else counted


def _collective_op(instr: Instr, in_async: bool, types: dict[str, str]) -> tuple | None:
    """(kind, group size, torus dims, engine, bytes counted) of a collective op, else None."""
    op = instr.opcode
    kind = next((k for k in COLLECTIVES if op in (k, f"{k}-start")), None)
    if not kind:
        return None
    operand_bytes = sum(nbytes(types.get(o, "")) for o in instr.operands)
    moved = nbytes(instr.type) if kind == "all-gather" and op == kind else operand_bytes
    return (kind, _group_size(instr.attrs), *collective(instr, in_async), moved)


# Top-level ops that move no data of their own: structure, control flow, async halves
# (their work is costed where they start), and collectives (costed on the interconnect).
_NO_DATA = {"parameter", "get-tuple-element", "tuple", "bitcast", "constant", "while",
            "call", "conditional", "after-all", "partition-id", "replica-id", "opt-barrier",
            "add-dependency", "domain", "send", "recv", "send-done", "recv-done"}  # fmt: skip


def _op_hbm_bytes(instr: Instr, computations: dict[str, list[Instr]],
                  types: dict[str, str]) -> float:  # fmt: skip
    """HBM bytes a top-level op reads and writes (VMEM-resident values excluded): a fusion
    what it reads and writes (`fusion_hbm_bytes`); an in-place dynamic-update-slice its
    update, read and written; a slice what it takes, read and written; any other op that
    computes (a matmul, a copy, a kernel, an unfused elementwise op, reduce, sort, ...) its
    operands and its output, once (a sort's passes over its data are not counted)."""
    op = instr.opcode
    if op == "fusion":
        return fusion_hbm_bytes(instr, computations, types)
    if (op in _NO_DATA or op.endswith(("-start", "-done"))
            or op in COLLECTIVES):  # fmt: skip
        return 0.0
    if op == "dynamic-update-slice" and len(instr.operands) > 1:
        return 2 * nbytes(types.get(instr.operands[1], ""), "S(1)")
    if op in ("dynamic-slice", "slice"):
        return 2 * nbytes(instr.type, "S(1)")
    operands = sum(nbytes(types.get(o, ""), "S(1)") for o in instr.operands)
    return operands + nbytes(instr.type, "S(1)")


def _kernel_key(instr: Instr, types: dict[str, str]) -> tuple | None:
    """A Mosaic kernel call's (name, output dims, cost-estimate FLOPs and bytes, grid, blocks,
    tiling: see trainer/compile/mosaic.py; and the precision its matmuls run in: fp8 when an operand
    is fp8, as in fp8 experts' grouped matmuls, else bf16)."""
    if instr.opcode != "custom-call":
        return None
    kernel = kernel_call(instr.name, instr.attrs)
    if not kernel:
        return None
    out = next((tuple(dims) for _, dims, _ in arrays(instr.type)), ())
    fp8 = any(d.startswith("f8") for o in instr.operands for d, _, _ in arrays(types.get(o, "")))
    return (
        kernel["name"],
        out,
        *(kernel[k] for k in ("flops", "bytes", "grid", "blocks", "tiling")),
        "fp8" if fp8 else "bf16",
    )


def program_cost(hlo_text: str) -> dict:
    """The per-device cost of one step of a compiled program (see module docstring), with
    its `schedule` (see `schedule`)."""
    computations, entry, types = parse(hlo_text)
    cost = Cost()
    by_name = {i.name: i for instrs in computations.values() for i in instrs}
    matmul_bodies = _with_matmuls(computations)
    fused = {callee for instrs in computations.values() for i in instrs
             if i.opcode == "fusion" and (callee := _callee(i))}  # fmt: skip

    def walk(name: str, times: float, seen: tuple[str, ...], in_async: bool = False) -> None:
        if name not in computations or name in seen:
            return
        top_level = name not in fused
        for instr in computations[name]:
            op = instr.opcode
            if op in ("dot", "convolution"):
                cost.flops[_precision(instr, types)] += matmul_flops(instr, types) * times
            found = _collective_op(instr, in_async, types)
            if found:
                kind, group, dims, engine, moved = found
                cost.collective_bytes[kind] += moved * times
                cost.collective_group_sizes[kind].add(group)
                cost.collective_ops[(kind, group, dims, engine)] += moved * times
            if op == "custom-call":
                target = re.search(r'custom_call_target="([^"]*)"', instr.attrs)
                if target and not target.group(1).startswith(("PrepareAsync", "Allocate")):
                    cost.custom_calls[target.group(1)] += times
                key = _kernel_key(instr, types)
                if key:
                    cost.kernel_calls[key] += times
            moved = _op_hbm_bytes(instr, computations, types) * times if top_level else 0.0
            cost.hbm_bytes += moved
            # The TensorCore runs one op at a time: an op without matrix products (a copy,
            # an elementwise or reduction fusion) is HBM time no matmul hides. Mosaic
            # kernels (custom calls) count as matmul work: their FLOPs come from formulas.
            if (
                moved
                and op not in ("dot", "convolution", "custom-call")
                and (_callee(instr) or "") not in matmul_bodies
            ):
                cost.hbm_bytes_without_matmul += moved
            cost.host_transfer_bytes += host_bytes(instr, types) * times
            if op == "while":
                body = re.search(r"body=%([\w.-]+)", instr.attrs)
                trips = _trips(instr, computations, by_name)
                cost.loop_trips.append(trips)
                if body:
                    walk(body.group(1), times * trips, (*seen, name), in_async)
                continue
            if op.endswith("-done"):
                continue
            for how, callee in _CALLEES.findall(instr.attrs):
                # to_apply names a reducer (scalar) except on calls, async ones included
                if how != "to_apply" or op in ("call", *_ASYNC_CALLS):
                    walk(callee, times, (*seen, name), in_async or op in _ASYNC_CALLS)

    walk(entry, 1.0, ())
    return {
        **cost.as_dict(),
        "schedule": schedule(
            computations, entry, types, list(cost.kernel_calls), by_name, matmul_bodies
        ),
    }


def _called(instr: Instr) -> list[str]:
    """What an op calls and runs (not a reducer's `to_apply`, except on calls)."""
    return [callee for how, callee in _CALLEES.findall(instr.attrs)
            if how != "to_apply" or instr.opcode in ("call", *_ASYNC_CALLS)]  # fmt: skip


def schedule(computations: dict[str, list[Instr]], entry: str, types: dict[str, str],
             kernels: list[tuple], by_name: dict[str, Instr],
             matmul_bodies: set[str]) -> dict:  # fmt: skip
    """The program as the TensorCore runs it, in its scheduled order: for each computation
    the TensorCore runs (the entry, loop bodies, called computations), a list of events:

    - `["tc", fp8, bf16, f32, hbm, matmul, kernel]`: an op the TensorCore runs, its matrix
      FLOPs by precision, HBM bytes, whether it holds a matrix product, the index of its
      Mosaic kernel call in `kernel_calls` (-1: none); neighbouring ops without matmuls
      are merged.
    - `["start", name, engine, work]`: an asynchronous op begins (a `-start`: a collective,
      a host copy, a call to the SparseCores), `work` what it does (see `work_of`); `engine`
      the unit that runs it (`sparsecore`, `ici`, `host`, `async`).
    - `["done", name]`: the TensorCore waits for that op.
    - `["wait", work]`: an op the TensorCore runs and waits for (a synchronous collective,
      a transfer to or from the host).
    - `["loop", body, trips]` and `["call", callee]`.

    `by_name` (every instruction) and `matmul_bodies` (`_with_matmuls`) are the walk's.
    """
    index = {key: k for k, key in enumerate(kernels)}
    memo: dict[str, dict[str, float]] = {}
    lists: dict[str, list] = {}

    def flops_within(name: str) -> dict[str, float]:
        if name not in memo:
            memo[name] = {}
            total: dict[str, float] = defaultdict(float)
            for instr in computations.get(name, []):
                if instr.opcode in ("dot", "convolution"):
                    total[_precision(instr, types)] += matmul_flops(instr, types)
                for callee in re.findall(r"\bcalls=%([\w.-]+)", instr.attrs):
                    for precision, flops in flops_within(callee).items():
                        total[precision] += flops
            memo[name] = dict(total)
        return memo[name]

    def build(name: str) -> None:
        if name in lists or name not in computations:
            return
        events: list = []
        lists[name] = events
        for instr in computations[name]:
            op = instr.opcode
            if op == "while":
                body = re.search(r"body=%([\w.-]+)", instr.attrs)
                if body:
                    build(body.group(1))
                    events.append(["loop", body.group(1), _trips(instr, computations, by_name)])
            elif op.endswith("-done"):
                events.append(["done", instr.operands[0] if instr.operands else ""])
            elif op.endswith("-start"):
                events.append(["start", instr.name, _engine(instr, types), work_of(instr)])
            elif op == "call":
                for callee in _called(instr):
                    build(callee)
                    events.append(["call", callee])
            elif _collective_op(instr, False, types) or host_bytes(instr, types):
                events.append(["wait", work_of(instr)])
            else:
                callee = _callee(instr) or ""
                own = matmul_flops(instr, types)
                flops = dict(flops_within(callee)) if op == "fusion" else {}
                if own:
                    flops[_precision(instr, types)] = own
                kernel = index.get(_kernel_key(instr, types), -1)
                matmul = bool(own) or kernel >= 0 or callee in matmul_bodies
                hbm = _op_hbm_bytes(instr, computations, types)
                if not matmul and not hbm:
                    continue
                if not matmul and events and events[-1][0] == "tc" and not events[-1][5]:
                    events[-1][4] += hbm
                    continue
                fp8, bf16, f32 = (flops.get(p, 0.0) for p in ("fp8", "bf16", "f32"))
                events.append(["tc", fp8, bf16, f32, hbm, int(matmul), kernel])

    def work_of(instr: Instr) -> dict:
        """What an asynchronous or waited-for op does: the collectives it runs (kind, group,
        torus dims, bytes), the HBM bytes of the ops it runs, and its host transfer bytes;
        for a call, what its callee does."""
        work: dict = {"ici": [], "hbm": 0.0, "host": host_bytes(instr, types)}
        found = _collective_op(instr, True, types)
        if found:
            kind, group, dims, _, moved = found
            work["ici"].append([kind, group, dims, moved])
        if instr.opcode == "copy-start" and not work["host"]:
            work["hbm"] += 2 * sum(nbytes(types.get(o, "")) for o in instr.operands)
        if instr.opcode in _ASYNC_CALLS:
            for callee in _called(instr):
                for inner in computations.get(callee, []):
                    if inner.opcode in ("parameter", "tuple", "get-tuple-element"):
                        continue
                    done = work_of(inner)
                    work["ici"] += done["ici"]
                    work["host"] += done["host"]
                    work["hbm"] += done["hbm"] + (
                        _op_hbm_bytes(inner, computations, types) if not done["ici"] else 0.0
                    )
        return work

    build(entry)
    return {"entry": entry, "computations": lists}


def _engine(instr: Instr, types: dict[str, str]) -> str:
    """The unit an asynchronous op runs on: the SparseCores (an async call on their thread),
    the interconnect (a collective), the host link (a transfer to or from the host)."""
    thread = re.search(r'async_execution_thread="(\w+)"', instr.attrs)
    if thread and thread.group(1) != "main":
        return thread.group(1)
    if _collective_op(instr, True, types):
        return "ici"
    return "host" if host_bytes(instr, types) else "async"
