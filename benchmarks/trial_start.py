"""A trial's start on CPU: a tiny dense trial's trainer process, phase by phase, as it runs
now and with what it did before 2026-12-08 put back (the baseline, in the same run).

    python -m benchmarks.trial_start [--repeats 3]

Baseline: the state's init compiled with LLVM's optimizations on CPU (INIT_COMPILE_OPTIONS
emptied), and tokamax and qwix imported before the trainer starts, as every trainer did
whatever its kernels. Each row is the median of `--repeats` processes, alternated; no JAX
cache, so every process compiles. Phases from the trainer's own events: start (process
start to `accepted`: imports, devices, the program built), compile (`compiled`), init and
the first step (to the first `step`), the rest (to exit). Fidelity: run, this host's CPU;
the finding is a CPU trial's start (what the test suite and a CPU sweep pay per trial), not
a speed of any TPU.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console

from benchmarks.tables import compact
from trainer.trial.events import JAX_CACHE_ENV

CONFIG = {
    "model": {"preset": "tiny-dense"},
    "seq_len": 64,
    "per_device_batch": 1,
    "steps": 4,
    "backend": "cpu",
    "num_devices": 8,
    "mesh": {"tensor": 2, "fsdp": -1},
}
BEFORE = (
    "import tokamax, qwix\n"
    "import trainer.program.build as build\n"
    "build.INIT_COMPILE_OPTIONS.clear()\n"
    "import sys\n"
    "from trainer.cli import main\n"
    "sys.exit(main())"
)
WAYS = {"before (baseline)": ["-c", BEFORE], "now": ["-m", "trainer"]}
NO_CACHE = (JAX_CACHE_ENV, "JAX_COMPILATION_CACHE_DIR")  # every process compiles
PHASES = ("start", "compile", "init + step 0", "rest", "whole")


def phases(args: list[str], config: Path) -> dict[str, float]:
    """One trainer process's phases, seconds, from its events' arrival times."""
    env = {k: v for k, v in os.environ.items() if k not in NO_CACHE}
    env["JAX_PLATFORMS"] = "cpu"
    started = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, *args, "--config", str(config)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=env,
    )
    seen: dict[str, float] = {}
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("{"):
            event = json.loads(line)["event"]
            seen.setdefault(event, time.perf_counter() - started)
    code = proc.wait()
    whole = time.perf_counter() - started
    if code != 0 or "summary" not in seen:
        raise SystemExit(f"the trainer failed ({' '.join(args[:1])}): exit {code}")
    return {
        "start": seen["accepted"],
        "compile": seen["compiled"] - seen["accepted"],
        "init + step 0": seen["step"] - seen["compiled"],
        "rest": whole - seen["step"],
        "whole": whole,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    runs: dict[str, list[dict[str, float]]] = {way: [] for way in WAYS}
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "trial.json"
        config.write_text(json.dumps(CONFIG))
        for _ in range(args.repeats):
            for way, argv in WAYS.items():
                runs[way].append(phases(argv, config))
    median = {
        way: {p: statistics.median(r[p] for r in rows) for p in PHASES}
        for way, rows in runs.items()
    }
    base = median["before (baseline)"]
    table = compact(
        f"A tiny dense trial's trainer on {os.cpu_count()} CPU cores, seconds "
        f"(median of {args.repeats})",
        caption="fidelity run, this host's CPU: a CPU trial's start, not a TPU's speed",
    )
    table.add_column("way")
    for phase in PHASES:
        table.add_column(phase, justify="right")
    for way, row in median.items():
        table.add_row(way, *(f"{row[p]:.2f}" for p in PHASES))
    table.add_row(
        "now / before", *(f"{median['now'][p] / base[p]:.2f}" if base[p] else "-" for p in PHASES)
    )
    Console(width=80).print(table)


if __name__ == "__main__":
    main()
