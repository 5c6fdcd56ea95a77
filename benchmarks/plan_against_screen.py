"""`sweeper plan` against `sweeper screen`, on the five published Ironwood workloads: the
advice's est. tokens/s beside the best point the screen finds in the space `plan --space`
writes (per precision) and in the shipped recipe space, where there is one. Same estimate,
same host, same run; every figure is fidelity estimate (datasheet + formulas), not a
measurement.

    python -m benchmarks.plan_against_screen

The plan must never advise less than the screen finds in the space it writes.
"""

from __future__ import annotations

import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import yaml
from rich.console import Console
from rich.table import Table

from sweeper.search.plan import space_for
from sweeper.search.screen import FITS, screen
from sweeper.space.load import load_space
from trainer.estimate.plan import Recommendation, recommend

# The published Ironwood workloads (tpu-recipes) on their topologies, and the shipped space
# whose trial 0 is the recipe (None where none is shipped).
WORKLOADS: dict[str, tuple[str, int, str, str | None]] = {
    "llama3.1-70b 8k": ("llama3.1-70b", 8192, "tpu7x:4x4x4", "llama31_70b_8k_tpu7x"),
    "llama3.1-70b 128k": ("llama3.1-70b", 131072, "tpu7x:4x8x8", "llama31_70b_128k_tpu7x"),
    "llama3.1-405b 8k": ("llama3.1-405b", 8192, "tpu7x:4x8x8", "llama31_405b_8k_tpu7x"),
    "qwen3-235b-a22b 4k": ("qwen3-235b-a22b", 4096, "tpu7x:4x8x8", "qwen3_235b_4k_tpu7x"),
    "mixtral-8x7b 4k": ("mixtral-8x7b", 4096, "tpu7x:4x4x4", None),
}
PRECISION = "knob:precision.mode"


@dataclass
class Compared:
    rec: Recommendation
    points: int  # in the written space
    written_bf16: float  # the screen's best bf16 point of the written space
    written_fp8: float
    shipped_bf16: float | None  # the screen's best bf16 point of the shipped recipe space
    seconds: float  # plan and screen


def best_of(name_or_path: str, precision: str) -> tuple[float, int]:
    """The screen's best est. tokens/s/chip among the points in `precision` that fit, and the
    number of points screened."""
    frame = screen(load_space(name_or_path))
    fits = frame[frame["verdict"] == FITS]
    if PRECISION in fits:
        fits = fits[fits[PRECISION] == precision]
    return float(fits["est_tokens_per_sec_per_chip"].max()), len(frame)


def compare(workload: str) -> Compared:
    model, seq, target, shipped = WORKLOADS[workload]
    started = time.perf_counter()
    rec = recommend({"preset": model}, seq, target)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "plan.yaml"
        written = space_for(rec, {"preset": model}, seq, target, "plan")
        path.write_text(yaml.safe_dump(written, sort_keys=False))
        bf16, points = best_of(str(path), "bf16")
        fp8, _ = best_of(str(path), "fp8")
    recipe = best_of(shipped, "bf16")[0] if shipped else None
    return Compared(rec, points, bf16, fp8, recipe, time.perf_counter() - started)


def main() -> None:
    table = Table(title="plan's advice against the screen (est. tokens/s/chip, fidelity estimate)")
    for col in ("workload", "advice", "written space", "advice fp8", "written fp8", "recipe space"):
        table.add_column(col, justify="right")
    for workload in WORKLOADS:
        got = compare(workload)
        fp8 = got.rec.fp8.tokens if got.rec.fp8 else float("nan")
        table.add_row(
            workload,
            f"{got.rec.best.tokens:,.0f}",
            f"{got.written_bf16:,.0f} ({got.points} points)",
            f"{fp8:,.0f}",
            f"{got.written_fp8:,.0f}",
            "-" if got.shipped_bf16 is None else f"{got.shipped_bf16:,.0f}",
        )
        print(f"{workload}: {got.rec.best.describe()} ({got.seconds:.1f} s)")
    Console(width=110).print(table)


if __name__ == "__main__":
    main()
