"""The tiles tokamax's TPU grouped-matmul kernel runs with, known without importing tokamax
(no JAX: the analytic estimate prices them, and the engine imports the estimate): its tuned
tables and its Config's default tiles, read from the installed tokamax's own source
(tokamax/_src/ops/ragged_dot/pallas_mosaic_tpu.py), and the rule by which a trial picks
from them (trainer/model/grouped_matmul.py builds the kernel with the same picks)."""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path
from typing import Any

from trainer.trial.config import GMM_PASSES, MAXTEXT_TILES, TokamaxTiles

KERNEL_SOURCE = Path("_src", "ops", "ragged_dot", "pallas_mosaic_tpu.py")
# tokamax's tuned tiles for its TPU kernels, by (m, k, n, groups, quantized): m routed rows,
# k the input's features, n the output's; one table per pass (see TokamaxTiles). tokamax
# 0.0.12 has these tables; 0.0.17 has none: its kernel picks tiles for the shape by its own
# VMEM budget (`_get_heuristics_config`, fp8 operands included), which can exceed libtpu's
# default scoped VMEM limit (1024x2048x1024 for a bf16 weight gradient at [8, 2048, 1024]
# took 35.37 MiB, over 32: seen with libtpu 0.0.52). So without tables the unset passes take
# MaxText's configured default tiles (MAXTEXT_TILES; MaxText 0.2.5's own tokamax path passes
# none, so there the two default programs differ).
TABLE_NAMES = {
    "fwd": "GMM_TILING_TUNED_LUT",
    "dlhs": "GMM_RHS_TRANSPOSE_TILING_TUNED_LUT",
    "drhs": "TGMM_TILING_TUNED_LUT",
}


def _kernel_module() -> ast.Module | None:
    """The installed tokamax's TPU kernel module, parsed (not imported); None without one."""
    spec = importlib.util.find_spec("tokamax")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / KERNEL_SOURCE
    return ast.parse(path.read_text()) if path.exists() else None


def _read() -> tuple[dict[str, dict[tuple[Any, ...], Any]], tuple[int, int, int]]:
    """(tokamax's tuned table of each pass, its Config's default (tile_m, tile_k, tile_n))."""
    module = _kernel_module()
    tables: dict[str, dict[tuple[Any, ...], Any]] = {name: {} for name in TABLE_NAMES}
    own = {"tile_m": 128, "tile_k": 128, "tile_n": 128}  # tokamax 0.0.12's, where unread
    for node in module.body if module else []:
        if isinstance(node, ast.AnnAssign | ast.Assign) and node.value is not None:
            target = node.target if isinstance(node, ast.AnnAssign) else node.targets[0]
            for name, table in TABLE_NAMES.items():
                if isinstance(target, ast.Name) and target.id == table:
                    tables[name] = ast.literal_eval(node.value)
        if isinstance(node, ast.ClassDef) and node.name == "Config":
            for field in node.body:
                if (isinstance(field, ast.AnnAssign) and isinstance(field.target, ast.Name)
                        and field.target.id in own and isinstance(field.value, ast.Constant)):  # fmt: skip
                    own[field.target.id] = int(str(field.value.value))
    return tables, (own["tile_m"], own["tile_k"], own["tile_n"])


TABLES, OWN_DEFAULT = _read()
UNSET = None if any(TABLES.values()) else MAXTEXT_TILES  # an unset pass's tiles (None: tokamax's)


def picks(
    dims: tuple[int, int, int], groups: int, weight: str, tiles: TokamaxTiles, fp8: bool
) -> dict[str, tuple[tuple[int, ...] | None, int]]:
    """(tiles, input buffers) of each pass for a forward of `dims` (m, k, n) over `groups`
    experts: the knob's (clamped to the pass's dims); where tokamax has no tables, MaxText's
    defaults; else, for fp8 operands where tokamax's table has no fp8 entry, its bf16 one for
    the shape (tokamax would take 128 x 128 x 128, a quarter of TPU7x's MXU; fp8 tiles take
    half the VMEM of bf16 ones); else None, tokamax's own choice."""
    m, k, n = dims
    chosen = tiles.of(weight, {"fwd": (m, k, n), "dlhs": (m, n, k), "drhs": (m, k, n)},
                      default=UNSET)  # fmt: skip
    out: dict[str, tuple[tuple[int, ...] | None, int]] = {}
    for name in GMM_PASSES:
        table, buffers = TABLES[name], 2
        tuned = table.get((m, k, n, groups, False))
        if not chosen[name] and fp8 and (m, k, n, groups, True) not in table and tuned:
            chosen[name], buffers = tuned
        out[name] = (chosen[name], buffers)
    return out


def run_tiles(
    dims: tuple[int, int, int], groups: int, weight: str, tiles: TokamaxTiles, fp8: bool
) -> dict[str, tuple[int, ...]]:
    """The (tm, tk, tn) each pass of tokamax's TPU kernel runs with for a forward of `dims`
    (m, k, n) over `groups` experts, as this host's tokamax builds it: `picks`, and where
    that leaves the choice to tokamax, its own (`_get_heuristics_config` of tokamax 0.0.12:
    its table's entry for the forward's shape, else its Config's default, 128 x 128 x 128)."""
    m, k, n = dims
    out = {}
    for name, (picked, _) in picks(dims, groups, weight, tiles, fp8).items():
        entry = TABLES[name].get((m, k, n, groups, fp8))
        out[name] = picked or (entry[0] if entry else OWN_DEFAULT)
    return out


# VMEM of a TPU generation at which tokamax picks its own tiles (its heuristics run at
# generation 7 and on: TPU7x alone of ours). 64 MiB: with it the port below gives the tiles
# libtpu 0.0.52 compiled for MaxText 0.2.5's gpt-oss-120b recipe on tpu7x:4x4x4 (sweep
# 20261207-012409-1514: 128x2880x1408 forward, 1024x256x2880 weight gradient); 128 MiB would
# give 512x2880x2880.
HEURISTIC_VMEM_BYTES = {"tpu7x": 64 * 2**20}


def _deflate(tile: int) -> int:
    return max(tile // 2 // 128 * 128, 128)


def heuristic_tiles(dims: tuple[int, int, int], vmem_bytes: int) -> dict[str, tuple[int, ...]]:
    """The (tm, tk, tn) of each pass, in the estimate's order (`run_tiles`'), that tokamax
    0.0.17 picks for bf16 operands on TPU7x when its caller gives no config (tokamax.ragged_dot
    as MaxText 0.2.5's unquantized path calls it: layers/moe.py, `is_tokamax_v1_unquantized`):
    its `_get_heuristics_config` and `_tgmm_heuristics_config`
    (tokamax/_src/ops/ragged_dot/pallas_mosaic_tpu.py), ported: the largest tiles (rows
    capped at 1024), halved in whole 128s down to 128 (rows, then columns, then the
    contraction; for the weight gradient the weight's rows, its columns, then the routed
    rows) until two buffers of each input tile and three of the output tile, two bytes an
    element, fit 3/4 of half the VMEM. `dims`: the forward's (m, k, n)."""
    m, k, n = dims
    budget = vmem_bytes / 2 * 0.75

    def deflated(order: str, inputs: tuple[str, str], out: str) -> tuple[int, int, int]:
        """Tiles of axes m, k, n, deflated in `order` until the tiles of the two inputs and
        the output (each named by its two axes) fit the budget."""
        t = {"m": min(m, 1024), "k": k, "n": n}

        def size(tile: str) -> int:
            return t[tile[0]] * t[tile[1]]

        for axis in order:
            while (
                sum(2 * 2 * size(i) for i in inputs) + 3 * 2 * size(out) > budget and t[axis] > 128
            ):
                t[axis] = _deflate(t[axis])
        return t["m"], t["k"], t["n"]

    # the forward's (lhs m x k @ rhs k x n); the input gradient's is the same: tokamax reads the
    # same dims for it
    tm, tk, tn = deflated("mnk", ("mk", "kn"), "mn")
    # the weight gradient's (lhs m x k, rhs m x n, contracted over the routed rows m)
    drhs = deflated("knm", ("mk", "mn"), "kn")
    return {"fwd": (tm, tk, tn), "dlhs": (tm, tn, tk), "drhs": drhs}
