"""What a Mosaic (Pallas TPU) kernel call in a compiled TPU program says about itself.

XLA cannot look into a Mosaic kernel: in the optimized HLO it is a `tpu_custom_call` whose
backend config carries the kernel's serialized module and the cost estimate its author
attached to the `pallas_call`. The module holds the kernel's grid (`iteration_bounds`, a
dynamic axis such as Megablox's active row tiles read as None) and the block shape of each
operand and output (`window_bounds`), in the kernel's operand order then its outputs.
A kernel that pipelines by hand (tokamax's grouped matmuls) has no grid there; it states
its tiles in its xprof metadata (a frontend attribute).
"""

from __future__ import annotations

import base64
import functools
import re
from typing import Any

# The kernel's serialized module: first in the custom call config (jaxlib 0.10), or after
# other keys such as "allow_input_fusion" (MaxText 0.2.5's jax 0.12 and libtpu 0.0.52).
_BODY = re.compile(r'"custom_call_config":\{[^{}]*?"body":"([^"]+)"')
_ESTIMATE = re.compile(r'"cost_estimate":\{"flops":"(\d+)"[^}]*?"bytes_accessed":"(\d+)"')
_GRID = re.compile(r"iteration_bounds = array<i64: ([^>]*)>")
_BLOCKS = re.compile(r"window_bounds = array<i64: ([^>]*)>")
_TILING = re.compile(r'tile_m\\*": (\d+), \\*"tile_k\\*": (\d+), \\*"tile_n\\*": (\d+)')
_DYNAMIC = -(2**63)  # MLIR's ShapedType::kDynamic
# The grouped-matmul kernels by their HLO names: Megablox's gmm and tgmm, tokamax's
# (pipelined by hand, no blocks to read; 0.0.12: gmm_megablox, tgmm_megablox; 0.0.17:
# pallas_tpu_ragged_dot_gmm, _tgmm) and libtpu's lowering of XLA's ragged_dot (ragged-dot-*).
GROUPED_MATMULS = ("gmm", "tgmm", "ragged-dot-", "pallas_tpu_ragged_dot_")


def kernel_call(name: str, attrs: str) -> dict[str, Any] | None:
    """The kernel's name (the HLO instruction's, clone suffixes dropped), the FLOPs and bytes
    of its cost estimate, its grid and its block shapes, the (tm, tk, tn) tiles its metadata
    states (None where unreadable or not stated); None for a custom call that is not a
    Mosaic kernel."""
    body = _BODY.search(attrs)
    if body is None:
        return None
    estimate = _ESTIMATE.search(attrs)
    layout = module_layout(body.group(1))
    return {
        "name": re.sub(r"(\.(\d+|clone))+$", "", name),
        "flops": float(estimate.group(1)) if estimate else None,
        "bytes": float(estimate.group(2)) if estimate else None,
        "grid": layout[0] if layout else None,
        "blocks": layout[1] if layout else None,
        "tiling": tuple(int(t) for t in tiling.groups())
        if (tiling := _TILING.search(attrs))
        else None,
    }


@functools.lru_cache(maxsize=512)
def module_layout(body_b64: str) -> tuple[tuple, tuple] | None:
    """(grid, block shapes) of a serialized Mosaic module (bytecode or text); None when this
    jaxlib cannot read it (the module comes from a newer Mosaic, say)."""
    try:
        from jax._src.interpreters import mlir
        from jax._src.lib import tpu
        from jax._src.lib.mlir import ir
    except ImportError:
        return None
    module = base64.b64decode(body_b64)
    text = None
    # Megablox ships bytecode that parses with the TPU dialect alone; tokamax ships text
    # that needs the upstream dialects (func, arith, ...) as well.
    for context in (ir.Context(), mlir.make_ir_context()):
        context.allow_unregistered_dialects = True
        tpu.register_dialect(context)
        try:
            with context:
                text = str(ir.Module.parse(module))
            break
        except Exception:  # an unreadable module: try the next context
            continue
    if text is None:  # an unreadable module costs the estimate its tiles, nothing more
        return None
    grid = _GRID.search(text)
    if grid is None:
        return None
    bounds = tuple(None if int(b) == _DYNAMIC else int(b) for b in grid.group(1).split(","))
    blocks = tuple(tuple(int(d) for d in w.split(",")) for w in _BLOCKS.findall(text))
    return bounds, blocks
