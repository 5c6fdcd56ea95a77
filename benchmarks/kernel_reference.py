"""The step model's price of a kernel against its time on TPU7x as tokamax measured it.

    python -m benchmarks.kernel_reference [--rows]

tokamax ships its autotuning results for TPU7x (tokamax 0.0.17: `data/autotuning/tpu7x/` in
its package): for each kernel call it tuned, the shapes, the tiles it chose and five timings
of the kernel alone on one TPU7x device. They are the only TPU7x timings of these kernels we
hold (no TPU here): measured by tokamax's authors (fidelity run, TPU7x, their hardware; this
script takes the least of the five), against the step model's price of the same call
(fidelity estimate: `trainer.compile.step_model`, the path a compiled program's kernel call
takes: `kernel_flops`, `calls_seconds`, with the MXU efficiency fitted on whole steps).

Families: tokamax's grouped matmul (`pallas_mosaic_tpu_ragged_dot`: forward, input gradient,
weight gradient; bf16, its entries of uniform routing and no fused activation; and its two fp8
forward entries, fp8 weights with the activations quantized in the kernel) and Splash
attention (`pallas_mosaic_tpu_splash_attention` and `_vjp`: causal, no segments, sinks or
soft cap, queries as long as keys). An input-gradient entry's tiles are read as (rows,
contracted, output columns): tokamax 0.0.17's code passes them swapped ("Treat config.tile_n
as tk", ops/ragged_dot/pallas_mosaic_tpu.py), under which 7 of its 24 entries hold tiles
larger than their dimensions: they were timed under this reading.

Prints per family: entries, median error (modelled / measured - 1), median |error| and
Spearman's rank correlation; `--rows` every entry.
"""

from __future__ import annotations

import argparse
import itertools
import json
import re
import statistics
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import tokamax
from rich.console import Console
from rich.table import Table
from scipy.stats import spearmanr

from trainer.compile.step_model import (
    CallPrice,
    KernelTerms,
    calls_seconds,
    kernel_flops,
    kernel_seconds,
)
from trainer.trial.config import TrialConfig, load_config
from trainer.trial.hardware import ACCELERATORS
from trainer.trial.mxu import FP8, kernel_family

TIMINGS = Path(tokamax.__file__).parent / "data" / "autotuning" / "tpu7x"
ACCEL = ACCELERATORS["tpu7x"]
_GMM = "pallas_mosaic_tpu_ragged_dot.json"
_SPLASH = ("pallas_mosaic_tpu_splash_attention.json", "pallas_mosaic_tpu_splash_attention_vjp.json")
# ragged_dot's dimension numbers (lhs contracting, rhs contracting) -> the pass
_PASSES = {((1,), (1,)): "gmm forward", ((1,), (2,)): "gmm input gradient",
           ((0,), (0,)): "gmm weight gradient"}  # fmt: skip
# the kernel names a compiled program gives each pass (trainer/compile/mosaic.py reads them)
_KERNEL = {"gmm forward": "pallas_tpu_ragged_dot_gmm",
           "gmm input gradient": "pallas_tpu_ragged_dot_gmm_transpose_rhs",
           "gmm weight gradient": "pallas_tpu_ragged_dot_tgmm"}  # fmt: skip


class Entry(NamedTuple):
    family: str
    shapes: str
    tiles: str
    measured_s: float
    modelled_s: float
    terms: KernelTerms  # what the step model prices it by, to price it again

    @property
    def error(self) -> float:
        return self.modelled_s / self.measured_s - 1


def _dims(text: str) -> list[int]:
    """bf16[131072,7168] -> [131072, 7168]."""
    match = re.fullmatch(r"\w+\[([\d,]+)\]", text)
    if match is None:
        raise ValueError(f"not an array shape: {text}")
    return [int(d) for d in match[1].split(",")]


def _timings(name: str) -> Iterator[tuple[dict[str, Any], dict[str, Any], float]]:
    """(call key, config, least of its timings in seconds) for each entry of a file."""
    for key, configs in json.loads((TIMINGS / name).read_text()).items():
        for config, result in configs.items():
            yield json.loads(key), json.loads(config), min(result["evaluation_times_ms"]) / 1e3


def _moe(groups: int) -> TrialConfig:
    """A configuration whose only use is its experts on one device (a grouped matmul's
    groups): the step model reads the rest from the call."""
    model = {"vocab_size": 256, "d_model": 256, "num_layers": 1, "num_heads": 2,
             "num_kv_heads": 2, "head_dim": 128, "mlp_dim": 256, "num_experts": groups,
             "experts_per_token": 1}  # fmt: skip
    return load_config({"model": model, "seq_len": 256, "per_device_batch": 1,
                        "kernels": {"moe_gmm": "tokamax"}})  # fmt: skip


def _priced(config: TrialConfig, call: dict[str, Any]) -> tuple[float, KernelTerms]:
    """One execution of `call` as the step model prices it in a compiled program, and its
    terms."""
    call = {"times": 1.0, "bytes": None, "grid": None, "blocks": None, "precision": "bf16", **call}
    flops = kernel_flops(config, 1, 1, calls=[call], mxu_width=ACCEL.mxu_width)
    terms = KernelTerms(
        flops.each[0], flops.steps[0], flops.waits[0], call["precision"] == "fp8", flops.rescaled[0]
    )  # `calls_seconds` prices these
    return calls_seconds([call], flops, ACCEL)[0], terms


def grouped_matmuls() -> list[Entry]:
    entries = []
    for key, config, measured in _timings(_GMM):
        lhs, rhs_key, sizes = key["lhs"], key["rhs"], key["group_sizes"]
        fp8 = _fp8(lhs, rhs_key)
        if key["return_residuals"] or key.get("activation") or fp8 is None:
            continue  # fp4 or int weights; a residual output or a fused activation
        if isinstance(sizes, list):  # the routing as given: uniform over the groups
            if len(set(sizes)) != 1:
                continue
            sizes = {"num_groups": len(sizes)}
        (m, lhs_k), rhs = (
            _dims(lhs["value"] if fp8 else lhs),
            _dims(rhs_key["qvalue"] if fp8 else rhs_key),
        )
        numbers = key["ragged_dot_dimension_numbers"]["dot_dimension_numbers"][0]
        family = _PASSES[tuple(tuple(d) for d in numbers)]  # type: ignore[index]
        tiles = (config["tile_m"], config["tile_k"], config["tile_n"])
        groups = sizes["num_groups"]
        if family == "gmm forward":  # [m, k] x [G, k, n] -> [m, n]
            out, flops = [m, rhs[2]], 2 * m * lhs_k * rhs[2]
        elif family == "gmm input gradient":  # [m, n] x [G, k, n] -> [m, k], contracting n
            out, flops = [m, rhs[1]], 2 * m * lhs_k * rhs[1]
        else:  # [m, k] x [m, n] -> [G, k, n], contracting the rows
            out, flops = [groups, lhs_k, rhs[1]], 2 * m * lhs_k * rhs[1]
        call = {"name": _KERNEL[family], "out": out, "flops": float(flops), "tiling": tiles,
                "precision": "fp8" if fp8 else "bf16"}  # fmt: skip
        modelled, terms = _priced(_moe(groups), call)
        family += FP8 if fp8 else ""
        shapes = f"{rhs_key['qvalue']} x {lhs['value']}" if fp8 else f"{lhs} {rhs_key}"
        entries.append(Entry(family, f"{shapes} G={groups}",
                             "x".join(map(str, tiles)), measured, modelled, terms))  # fmt: skip
    return entries


def _fp8(lhs: Any, rhs: Any) -> bool | None:
    """False for bf16 operands, True for fp8 weights with activations tokamax quantizes to fp8
    in the kernel, None for anything else (fp4 weights, a quantized activation given)."""
    if isinstance(lhs, str) and isinstance(rhs, str):
        return False
    quantized = isinstance(lhs, dict) and "value" in lhs and isinstance(rhs, dict)
    if quantized and "float8_e4m3fn" in lhs["qtype"] and rhs["qvalue"].startswith("f8_e4m3fn"):
        return True
    return None


def splash() -> list[Entry]:
    entries = []
    for name, backward in zip(_SPLASH, (False, True), strict=True):
        for key, config, measured in _timings(name):
            (heads, seq, head_dim), (kv_heads, kv_seq, _) = _dims(key["q"]), _dims(key["k"])
            plain = not (key["segment_ids"] or key["sinks"] or key["attn_logits_soft_cap"])
            if not (key["mask"].get("is_causal") and plain and seq == kv_seq):
                continue
            names = ("block_q_dkv", "block_kv_dkv", "block_kv_dkv_compute") if backward else (
                "block_q", "block_kv", "block_kv_compute")  # fmt: skip
            blocks = {n: config[n] for n in names}
            model = {"vocab_size": 256, "d_model": heads * head_dim, "num_layers": 1,
                     "num_heads": heads, "num_kv_heads": kv_heads, "head_dim": head_dim,
                     "mlp_dim": 256}  # fmt: skip
            trial = load_config({"model": model, "seq_len": seq, "per_device_batch": 1,
                                 "kernels": {"attention": "splash", **blocks}})  # fmt: skip
            kernel = "splash_mha_dkv" if backward else "splash_mha_fwd"
            if not backward and key["return_residuals"]:
                kernel += "_residuals"  # what training runs: the backward reads them
            call = {"name": kernel, "out": [heads, seq, head_dim], "flops": None, "tiling": None}
            entries.append(Entry(kernel_family(call), f"{key['q']} {key['k']}",
                                 "/".join(str(b) for b in blocks.values()), measured,
                                 *_priced(trial, call)))  # fmt: skip
    return entries


def fit(entries: list[Entry]) -> dict[str, tuple[float, float | None]]:
    """Per family, the MXU efficiency (in steps of 0.005) and, for Splash, the cost of each
    accumulator element it rescales (in steps of 0.01 ps), with the least median |error| over
    its entries: `KERNEL_MXU_EFFICIENCY`'s and `SPLASH_RESCALE_S`'s figures."""
    grid = [x / 200 for x in range(40, 201)]
    fitted: dict[str, tuple[float, float | None]] = {}
    for family in dict.fromkeys(e.family for e in entries):
        chosen = [e for e in entries if e.family == family]
        costs = [x * 1e-14 for x in range(0, 61)] if family.startswith("Splash") else [None]

        def err(price: CallPrice, chosen: list[Entry] = chosen) -> float:
            return statistics.median(
                abs(kernel_seconds(e.terms, ACCEL, price) / e.measured_s - 1) for e in chosen
            )

        fitted[family] = tuple(min(itertools.starmap(CallPrice, itertools.product(grid, costs)),
                                   key=err))  # fmt: skip
    return fitted


def block_orders(entries: list[Entry]) -> dict[str, tuple[int, int]]:
    """Per Splash family: of the pairs of its entries for the same shapes whose measured
    times differ by 3% or more, how many the model orders as measured (what the tile tuner
    ranks Splash blocks by), and how many there are."""
    out = {}
    for family in dict.fromkeys(e.family for e in entries if e.family.startswith("Splash")):
        pairs = [
            (a, b)
            for a, b in itertools.combinations([e for e in entries if e.family == family], 2)
            if a.shapes == b.shapes and abs(a.measured_s / b.measured_s - 1) >= 0.03
        ]
        right = sum((a.modelled_s < b.modelled_s) == (a.measured_s < b.measured_s)
                    for a, b in pairs)  # fmt: skip
        out[family] = (right, len(pairs))
    return out


def summary(entries: list[Entry]) -> dict[str, dict[str, float]]:
    """Per family: entries, median error, median |error|, Spearman of modelled and measured."""
    out = {}
    for family in dict.fromkeys(e.family for e in entries):
        chosen = [e for e in entries if e.family == family]
        errors = [e.error for e in chosen]
        rho = spearmanr([e.measured_s for e in chosen], [e.modelled_s for e in chosen]).statistic
        out[family] = {"entries": float(len(chosen)), "median_error": statistics.median(errors),
                       "median_abs_error": statistics.median(abs(e) for e in errors),
                       "spearman": float(rho)}  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", action="store_true", help="print every entry")
    parser.add_argument("--fit", action="store_true",
                        help="print each family's constants fitted on these timings")  # fmt: skip
    args = parser.parse_args(argv)
    console = Console(width=160)
    entries = grouped_matmuls() + splash()
    if args.fit:
        console.print(fit(entries))
    if args.rows:
        rows = Table(title="each entry: measured (tokamax, TPU7x) and modelled (step model)")
        for column in ("family", "shapes", "tiles", "measured ms", "modelled ms", "error"):
            rows.add_column(column)
        for e in sorted(entries, key=lambda e: (e.family, e.error)):
            rows.add_row(e.family, e.shapes, e.tiles, f"{e.measured_s * 1e3:.3f}",
                         f"{e.modelled_s * 1e3:.3f}", f"{e.error:+.1%}")  # fmt: skip
        console.print(rows)
    table = Table(title=f"the step model against tokamax's TPU7x timings ({TIMINGS})")
    for column in ("family", "entries", "median error", "median |error|", "Spearman",
                   "same-shape pairs ordered as measured"):  # fmt: skip
        table.add_column(column)
    orders = block_orders(entries)
    for family, figures in summary(entries).items():
        right, pairs = orders.get(family, (0, 0))
        table.add_row(family, f"{figures['entries']:.0f}", f"{figures['median_error']:+.1%}",
                      f"{figures['median_abs_error']:.1%}", f"{figures['spearman']:+.2f}",
                      f"{right} of {pairs}" if pairs else "")  # fmt: skip
    console.print(table)
    console.print("measured: fidelity run, TPU7x (one device, tokamax's authors; the least of "
                  "five timings); modelled: fidelity estimate (the step model at each family's "
                  "efficiency, fitted on these timings: --fit)")  # fmt: skip


if __name__ == "__main__":
    main()
