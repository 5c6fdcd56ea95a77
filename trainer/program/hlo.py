"""Counting what a compiled HLO module does: its collectives and its matrix products."""

from __future__ import annotations

import hashlib
import re

COLLECTIVES = (
    "all-gather",
    "reduce-scatter",
    "all-reduce",
    "all-to-all",
    "ragged-all-to-all",  # expert-parallel token dispatch
    "collective-permute",
)


_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%([\w.-]+) = (.*)$")


def count_collectives(hlo_text: str) -> dict[str, int]:
    """Collectives in a compiled HLO module, each counted once in whichever form TPU emits it:
    a sync op (`all-gather(`), an async start (`all-gather-start(`), or an async call named
    after the collective (`%all-reduce.92.cloned.1.call-start = ... call-start(`)."""
    counts = dict.fromkeys(COLLECTIVES, 0)
    for line in hlo_text.splitlines():
        match = _INSTRUCTION.match(line)
        if not match:
            continue
        name, rest = match.groups()
        for op in COLLECTIVES:
            as_op = re.search(rf"\s{op}(?:-start)?\(", " " + rest)
            as_call = name.startswith(op) and " call-start(" in rest
            if as_op or as_call:
                counts[op] += 1
                break
    return counts


_MATMUL = re.compile(
    r"\s(?:dot|convolution)\(|custom-call\(.*custom_call_target=\"[^\"]*(?:gemm|matmul)"
)
_FP8 = re.compile(r"\bf8e(?:4m3|5m2)\w*\[")
_FP8_TARGET = re.compile(r'custom_call_target="[^"]*\$f8"')


def count_matmuls(hlo_text: str) -> dict[str, int]:
    """Matrix products in a compiled HLO module (dots, also inside fusions, and GEMM custom
    calls such as cuBLAS's), and how many of them read an fp8 operand: one printed with its
    fp8 type, one defined as fp8 elsewhere in the module, or an fp8 GEMM (`...$f8`)."""
    fp8_values: set[str] = set()
    products: list[str] = []
    for line in hlo_text.splitlines():
        match = _INSTRUCTION.match(line)
        if not match:
            continue
        name, rest = match.groups()
        if _FP8.match(rest):
            fp8_values.add(name)
        if _MATMUL.search(" " + rest):
            products.append(rest)
    fp8 = 0
    for rest in products:
        operands = rest[rest.index("(", 1 if rest.startswith("(") else 0) :]
        fp8 += bool(
            _FP8_TARGET.search(rest)
            or _FP8.search(operands)
            or fp8_values.intersection(re.findall(r"%([\w.-]+)", operands))
        )
    return {"total": len(products), "fp8": fp8}


_METADATA = re.compile(r",? metadata=\{[^}]*\}")


def fingerprint(hlo_text: str) -> str:
    """Identity of a compiled program: its optimized HLO without source metadata (which
    names the Python file and line each op came from, not what the program does)."""
    return hashlib.sha256(_METADATA.sub("", hlo_text).encode()).hexdigest()[:16]
