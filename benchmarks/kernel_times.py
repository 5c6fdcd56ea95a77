"""The tile tuner's kernel cost model against kernel timings, where a TPU is lent: trial 0 of
a space, its kernels (Splash forward and backward, tokamax's grouped matmuls) at the trial's
per-device shapes; for each candidate tile, the time tune-jax measures on this host's first
device (the part of the layer the kernel runs in: trainer/compile/tiles/timing.py) beside
the step model's price of that same program compiled for the same device (every kernel call
of it, `calls_seconds`: what `kernels.tune: compile` ranks by). Prints one row a candidate,
then per kernel and over all: Spearman of measured against modelled, median |error|.

    python -m benchmarks.kernel_times [--space llama31_70b_8k_tuned_tpu7x] [--set k=v ...]

    python -m benchmarks.kernel_times --records TIMED PRICED   # on any host, from records

On a host without a TPU nothing is measured and it says so (exit 2): a CPU interprets Pallas
TPU kernels, a GPU runs none of them. `--records` reads a chip's measurement instead: the
tuning record of a `kernels.tune: time` trial (tune-jax's time of each candidate's part
program) against a `kernels.tune: compile` trial's (the step model's price of each
candidate's calls in the whole layer, compiled for the same chip), each a JSON file holding
a `tuning` (or `rows` of which one has it): benchmarks/data/v5e_dense_kernel_tune.json
against benchmarks/data/v5e_dense_compile_tuned.json. A backward kernel's part program
holds the forward too (at the trial's own tiles, the same in every candidate): its ranks
compare, its times do not, and the table gives its Spearman alone. `--interpret-on-cpu` runs the whole script on this
CPU, Splash interpreted and priced as compiled for TPU7x, to check the script itself: its
figures are not a finding about any TPU (the table says so).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from rich.table import Table

from sweeper.space.checks import static_check
from sweeper.space.file import parse_value
from sweeper.space.load import load_space, space_overrides
from sweeper.space.points import first_point

CPU_CHECK = "CPU, interpreted (checks this script; not a finding about any TPU)"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--space", default="llama31_70b_8k_tuned_tpu7x")
    parser.add_argument("--set", action="append", default=[], help="override a space key")
    parser.add_argument("--interpret-on-cpu", action="store_true")
    parser.add_argument("--records", nargs=2, metavar=("TIMED", "PRICED"))
    args = parser.parse_args(argv)
    console = Console()
    if args.records:
        console.print(records_table(*(Path(p) for p in args.records)))
        return 0
    import jax

    device = jax.devices()[0]
    if device.platform != "tpu" and not args.interpret_on_cpu:
        console.print(f"no TPU on this host ({device.platform}: {device.device_kind}): nothing "
                      "measured. Run it where a TPU is lent.")  # fmt: skip
        return 2
    sets = {k: parse_value(v) for k, v in (item.split("=", 1) for item in args.set)}
    space = load_space(args.space, space_overrides({"set": sets}))
    config = static_check(space, first_point(space), space.num_devices)
    rows = measure(config, space.num_devices, device, args.interpret_on_cpu)
    console.print(table(rows, args.space, device, args.interpret_on_cpu))
    return 0


def measure(config: Any, num_devices: int, device: Any, interpret: bool) -> list[dict[str, Any]]:
    """One row per kernel candidate: measured and modelled seconds of its part program."""
    from trainer.compile.aot import topology_devices
    from trainer.compile.tiles.families import families
    from trainer.compile.tiles.timing import time_kernel
    from trainer.trial.checks import global_batch_size

    degrees = config.mesh.resolve(num_devices)
    batch = global_batch_size(config, num_devices)
    found, _ = families(config, batch, degrees, device, interpret)
    # The model prices a program compiled for a TPU: this one's, or TPU7x's for the CPU check
    # (its kernels compiled, not interpreted).
    priced_on = device if device.platform == "tpu" else topology_devices("tpu7x:2x2x1")[0]
    priced = {f.name: f for f in families(config, batch, degrees, priced_on)[0]}
    rows = []
    for family in found:
        for kernel in family.knobs:
            for tried in time_kernel(family, kernel, config, device):
                if tried.seconds is None:
                    continue
                trial = family.trial(config, {**family.given, kernel: tried.blocks})
                modelled = modelled_seconds(priced[family.name], trial, kernel, batch, degrees)
                rows.append({"kernel": kernel, "tiles": tried.blocks,
                             "measured": tried.seconds, "modelled": modelled})  # fmt: skip
    return rows


def modelled_seconds(family, trial, kernel, batch, degrees) -> float:
    """The step model's time for every kernel call of the kernel's part program, compiled
    for the family's device."""
    from trainer.compile.cost import program_cost
    from trainer.compile.step_model import calls_seconds, kernel_flops
    from trainer.program.hlo import parse
    from trainer.program.kernels import compiled_hlo
    from trainer.trial.devices import accelerator_of

    accel = accelerator_of(family.device.device_kind)
    if accel is None:
        raise ValueError(f"no datasheet for {family.device.device_kind}")
    layer = family.layer(trial, family.parts[kernel])
    calls = program_cost(parse(compiled_hlo(layer, family.device)))["kernel_calls"]
    flops = kernel_flops(trial, batch, 1, 1, calls, degrees["expert"], accel.mxu_width)
    return sum(calls_seconds(calls, flops, accel))


def _spearman(a: list[float], b: list[float]) -> float:
    if len(a) < 2:
        return float("nan")
    ra, rb = np.argsort(np.argsort(a)), np.argsort(np.argsort(b))
    return float(np.corrcoef(ra, rb)[0, 1])


def table(rows: list[dict[str, Any]], space: str, device: Any, interpret: bool) -> Table:
    where = CPU_CHECK if interpret and device.platform != "tpu" else device.device_kind
    out = Table(title=f"{space}: kernel candidates, measured (tune-jax) against modelled (step "
                      f"model) on {where}")  # fmt: skip
    for column in ("kernel", "tiles", "measured µs", "modelled µs", "modelled/measured"):
        out.add_column(column, justify="right")
    for row in rows:
        out.add_row(row["kernel"], "x".join(map(str, row["tiles"])), f"{row['measured'] * 1e6:,.1f}",
                    f"{row['modelled'] * 1e6:,.1f}", f"{row['modelled'] / row['measured']:.3f}")  # fmt: skip
    errors = [abs(r["modelled"] / r["measured"] - 1) for r in rows]
    for kernel in dict.fromkeys(r["kernel"] for r in rows):
        mine = [r for r in rows if r["kernel"] == kernel]
        rho = _spearman([r["measured"] for r in mine], [r["modelled"] for r in mine])
        out.add_row(kernel, "Spearman", f"{rho:.2f}", "", "")
    rho = _spearman([r["measured"] for r in rows], [r["modelled"] for r in rows])
    median = statistics.median(errors) if errors else float("nan")
    out.caption = json.dumps({"spearman": round(rho, 3), "median_abs_error": round(median, 3),
                              "candidates": len(rows)})  # fmt: skip
    return out


def tuning_of(path: Path) -> dict[str, Any]:
    """The tuning record in a file: its `tuning`, or that of the first of its `rows` with one."""
    data = json.loads(path.read_text())
    found = data.get("tuning") or next(
        (r["tuning"] for r in data.get("rows", []) if r.get("tuning")), None
    )
    if not found:
        raise SystemExit(f"{path}: no tuning record")
    return found


def records_table(timed: Path, priced: Path) -> Table:
    """Each candidate timed on a chip beside the step model's price of it (module doc)."""
    by_kernel = {k["kernel"]: k for k in tuning_of(priced)["kernels"]}
    out = Table(title=f"kernel candidates: timed ({timed.name}) against priced ({priced.name})")
    for column in ("kernel", "tiles", "time µs", "price µs", "ratio", "refused"):
        out.add_column(column, justify="right", no_wrap=column in ("kernel", "tiles"))
    summary = {}
    for kernel in tuning_of(timed)["kernels"]:
        prices = {
            tuple(t["blocks"]): t for t in by_kernel.get(kernel["kernel"], {}).get("tried", [])
        }
        pairs = []
        forward = "forward" in kernel["kernel"]
        for tried in kernel["tried"]:
            price = prices.get(tuple(tried["blocks"]), {})
            t, p = tried.get("seconds"), price.get("seconds")
            refused = [w for w, s in (("chip", t), ("price", p)) if s is None]
            ratio = f"{p / t:.3f}" if t and p and forward else ""
            out.add_row(kernel["kernel"], "x".join(map(str, tried["blocks"])),
                        f"{t * 1e6:,.0f}" if t else "-", f"{p * 1e6:,.0f}" if p else "-", ratio,
                        ", ".join(refused))  # fmt: skip
            if t and p:
                pairs.append((t, p))
        rho = _spearman([t for t, _ in pairs], [p for _, p in pairs])
        chosen = {
            "timed": kernel["chosen"],
            "priced": by_kernel.get(kernel["kernel"], {}).get("chosen"),
        }
        summary[kernel["kernel"]] = {"spearman": round(rho, 2), "candidates": len(pairs), **chosen}
        if forward:
            errors = [abs(p / t - 1) for t, p in pairs]
            summary[kernel["kernel"]]["median_abs_error"] = round(statistics.median(errors), 3)
    out.caption = json.dumps(summary)
    return out


if __name__ == "__main__":
    sys.exit(main())
