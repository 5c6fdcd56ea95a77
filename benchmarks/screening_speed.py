"""Screening speed: points judged per minute by the analytic estimate in this process
(sweeper/screen.py), against the same estimate as the engine ran it before the screen: one
child process (`python -m trainer --estimate-only`) per point. Same run, same host.

    python -m benchmarks.screening_speed [--space llama31_70b_8k_tpu7x] [--children 5]

The issue's goal: 10,000 points a minute on a 2-core host.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from sweeper.search.screen import screen
from sweeper.space.checks import static_check
from sweeper.space.load import load_space
from sweeper.space.points import points


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--space", default="llama31_70b_8k_tpu7x")
    parser.add_argument("--children", type=int, default=5, help="points estimated by a child each")
    args = parser.parse_args()
    space = load_space(args.space)
    started = time.perf_counter()
    frame = screen(space)
    in_process = len(frame) / (time.perf_counter() - started) * 60
    # The baseline: a child process per point, as an estimate-fidelity trial ran.
    chosen = points(space, args.children)
    with tempfile.TemporaryDirectory() as tmp:
        started = time.perf_counter()
        for i, point in enumerate(chosen):
            path = Path(tmp) / f"trial{i}.json"
            path.write_text(static_check(space, point).to_json())
            subprocess.run([sys.executable, "-m", "trainer", "--config", str(path), "--estimate-only"],
                           check=True, capture_output=True)  # fmt: skip
        per_child = len(chosen) / (time.perf_counter() - started) * 60
    table = Table(title=f"screening {space.name} ({len(frame)} points), fidelity estimate")
    for col in ("how", "points/min", "vs a child per point"):
        table.add_column(col, justify="right")
    table.add_row("a child process per point (baseline)", f"{per_child:,.0f}", "1.0x")
    table.add_row(
        "in process (sweeper screen)", f"{in_process:,.0f}", f"{in_process / per_child:,.0f}x"
    )
    Console(width=160).print(table)


if __name__ == "__main__":
    main()
