"""The one reader of compiled HLO text (as libtpu and XLA print it): its computations,
instructions and the type of every value, the bytes a type holds in each memory space;
and what the run and the compile both count in a program: its collectives, its matrix
products, its identity. JAX-free.
"""

from __future__ import annotations

import hashlib
import math
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import NamedTuple

# TPU memory spaces in a layout (`{1,0:S(1)}`): a kernel's VMEM holds values off HBM; pinned
# host memory is where offloaded tensors go.
VMEM_SPACE = "S(1)"
HOST_SPACE = "S(5)"
BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "bf16": 2, "f16": 2,
         "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8}  # fmt: skip
COLLECTIVES = (
    "all-gather",
    "reduce-scatter",
    "all-reduce",
    "all-to-all",
    "ragged-all-to-all",  # expert-parallel token dispatch
    "collective-permute",
)
# Ops that start a computation running beside the TensorCore. libtpu 0.0.52 (MaxText 0.2.5's)
# wraps a SparseCore collective in an async custom call: `custom-call-start()` names the body
# (called_computations), `custom-call-update` hands it its operand, `custom-call-done` waits.
ASYNC_CALLS = ("call-start", "async-start", "custom-call-start")

_ARRAY = re.compile(r"\b(pred|[suf]\d+|bf16|f8e\w+)\[([\d,]*)\](\{[^}]*\})?")
_HEADER = re.compile(r"^(ENTRY )?%([\w.-]+) \((.*)\) -> .* \{$")
_INSTR = re.compile(r"^\s*(ROOT )?%([\w.-]+) = (.+?) ([\w-]+)\((.*?)\)(.*)$")
_PARAM = re.compile(r"([\w.-]+): ((?:\([^)]*\))|[^,]+(?:\[[^\]]*\])?)")
_CALLEES = re.compile(r"\b(calls|body|to_apply)=%([\w.-]+)")
_CALLED_COMPUTATIONS = re.compile(r"\bcalled_computations=\{([^}]*)\}")


@dataclass
class Instr:
    name: str
    type: str
    opcode: str
    operands: list[str]
    attrs: str
    args: str = ""  # the text between the parentheses (a constant's value)
    root: bool = False


def arrays(type_str: str) -> list[tuple[str, list[int], str]]:
    """(dtype, dims, layout) of each array in a (possibly tuple) HLO type."""
    return [
        (dtype, [int(d) for d in dims.split(",") if d], layout or "")
        for dtype, dims, layout in _ARRAY.findall(type_str)
    ]


def array_bytes(dtype: str, dims: list[int]) -> float:
    return math.prod(dims) * (1 if dtype.startswith("f8") else BYTES.get(dtype, 4))


def nbytes(type_str: str, skip_space: str | None = None) -> float:
    return sum(
        array_bytes(dtype, dims)
        for dtype, dims, layout in arrays(type_str)
        if not (skip_space and skip_space in layout)
    )


class Module(NamedTuple):
    """A parsed HLO module."""

    computations: dict[str, list[Instr]]  # in the printed (for a scheduled module: run) order
    entry: str
    types: dict[str, str]  # value name -> its HLO type

    def instructions(self) -> Iterator[Instr]:
        return (instr for body in self.computations.values() for instr in body)


# Where instructions outside any computation go (a fragment of a module, not a whole one).
LOOSE = ""


def parse(hlo_text: str) -> Module:
    """The module's computations by name, its entry's name, and every value's type by name."""
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
        if line == "}":
            current = None
            continue
        if current is None:
            if not _INSTR.match(line):
                continue
            current = LOOSE
            computations.setdefault(LOOSE, [])
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
    return Module(computations, entry, types)


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


def callee(instr: Instr) -> str | None:
    """The computation a fusion (or call) runs."""
    found = re.search(r"calls=%([\w.-]+)", instr.attrs)
    return found.group(1) if found else None


def called(instr: Instr) -> list[str]:
    """What an op calls and runs (not a reducer's `to_apply`, except on calls), and the
    computations a custom call runs (newer libtpu wraps a SparseCore collective's body so)."""
    names = [name for how, name in _CALLEES.findall(instr.attrs)
             if how != "to_apply" or instr.opcode in ("call", *ASYNC_CALLS)]  # fmt: skip
    custom = instr.opcode in ("custom-call", "custom-call-start")
    listed = _CALLED_COMPUTATIONS.search(instr.attrs) if custom else None
    if listed:
        names += re.findall(r"%([\w.-]+)", listed.group(1))
    return names


def collective_kind(instr: Instr) -> str | None:
    """The collective an op runs, in whichever form TPU emits it: a sync op (`all-gather`),
    an async start (`all-gather-start`), or an async call named after the collective
    (`%all-reduce.92.cloned.1.call-start = ... call-start(`); None for any other op."""
    for kind in COLLECTIVES:
        if instr.opcode in (kind, f"{kind}-start"):
            return kind
        if instr.opcode == "call-start" and instr.name.startswith(kind):
            return kind
    return None


def count_collectives(hlo: str | Module) -> dict[str, int]:
    """Collectives in a compiled module, each counted once (see `collective_kind`); in a
    multi-slice program also those between slices, as `dcn <kind>` (libtpu's megascale
    sends, `_xla_megascale_transfer_type`)."""
    module = parse(hlo) if isinstance(hlo, str) else hlo
    counts = dict.fromkeys(COLLECTIVES, 0)
    for instr in module.instructions():
        kind = collective_kind(instr)
        if kind:
            counts[kind] += 1
        between = megascale_kind(instr) if instr.opcode == "send" else None
        if between:
            counts[f"dcn {between}"] = counts.get(f"dcn {between}", 0) + 1
    return counts


_MEGASCALE = re.compile(r'_xla_megascale_transfer_type="(\w+)"')


def megascale_kind(instr: Instr) -> str | None:
    """The collective between slices a `send` or `recv` runs, else None. libtpu runs a
    multi-slice program's cross-slice collective as a host-transfer send of each device's
    operand to the megascale runtime and a recv of the result, tagged with the collective
    (`_xla_megascale_transfer_type="ALL_REDUCE"`: all-reduce)."""
    if instr.opcode not in ("send", "recv"):
        return None
    found = _MEGASCALE.search(instr.attrs)
    return found.group(1).lower().replace("_", "-") if found else None


_GEMM_TARGET = re.compile(r'custom_call_target="[^"]*(?:gemm|matmul)')
_FP8 = re.compile(r"\bf8e(?:4m3|5m2)\w*\[")
_FP8_TARGET = re.compile(r'custom_call_target="[^"]*\$f8"')


def is_matmul(instr: Instr) -> bool:
    """A matrix product: a dot or convolution (also inside fusions), or a GEMM custom call
    such as cuBLAS's."""
    return instr.opcode in ("dot", "convolution") or (
        instr.opcode == "custom-call" and bool(_GEMM_TARGET.search(instr.attrs))
    )


def count_matmuls(hlo: str | Module) -> dict[str, int]:
    """Matrix products in a compiled module (`is_matmul`), and how many of them read an fp8
    operand: one printed with its fp8 type, one defined as fp8 elsewhere in the module, or
    an fp8 GEMM (`...$f8`)."""
    module = parse(hlo) if isinstance(hlo, str) else hlo
    products = [i for i in module.instructions() if is_matmul(i)]
    fp8 = sum(
        bool(
            _FP8_TARGET.search(instr.attrs)
            or _FP8.search(instr.args)
            or any(_FP8.match(module.types.get(o, "")) for o in instr.operands)
        )
        for instr in products
    )
    return {"total": len(products), "fp8": fp8}


_METADATA = re.compile(r",? metadata=\{[^}]*\}")
# Newer XLA prints the source tables ops' metadata points into (files, functions, locations,
# stack frames) between the module line and the computations: where the program was traced
# from (the checkout's path, the caller's lines), not what it does.
_SOURCE_TABLES = re.compile(
    r"^(?:FileNames|FunctionNames|FileLocations|StackFrames)\n(?:[^\n]+\n)*", re.MULTILINE
)


def fingerprint(hlo_text: str) -> str:
    """Identity of a compiled program: its optimized HLO without source metadata (which
    names the Python file and line each op came from, and the tables it points into, not
    what the program does)."""
    text = _SOURCE_TABLES.sub("", _METADATA.sub("", hlo_text))
    return hashlib.sha256(text.encode()).hexdigest()[:16]
