"""Compile real model sizes for TPU7x on this host and print memory, estimate and compile time.

    python -m benchmarks.compile_real_models [--only llama3.1-70b]

Each case runs `python -m trainer --compile-only` in a child process (as a sweep trial
does). Memory per device, fits and collectives are compiler figures (fidelity compile);
step time and tokens/sec/chip are a roofline estimate (fidelity estimate). Target on a
2-core host: under 5 minutes per compile.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from trainer.program.hlo import COLLECTIVES
from trainer.trial.config import SPLASH_BLOCKS
from trainer.trial.hardware import GIB

ROOT = Path(__file__).resolve().parents[1]

KERNELS = {
    "attention": "splash",
    **dict.fromkeys(
        SPLASH_BLOCKS,
        1024,
    ),
}
CASES = {
    "llama3.1-70b": (
        "tpu7x:4x4x4",
        {
            "model": {"preset": "llama3.1-70b"},
            "seq_len": 8192,
            "per_device_batch": 1,
            "remat": {"policy": "full"},
            "kernels": KERNELS,
        },
    ),
    "mixtral-8x7b": (
        "tpu7x:2x2x2",
        {
            "model": {"preset": "mixtral-8x7b"},
            "seq_len": 4096,
            "per_device_batch": 1,
            "mesh": {"fsdp": -1, "expert": 8},
            "remat": {"policy": "full"},
            "kernels": KERNELS,
        },
    ),
}


def compile_trial(
    config: dict, target: str, python: str | None = None
) -> tuple[dict[str, dict], float]:
    """`python -m trainer --compile-only` in a child, as a sweep trial; its events by kind, wall
    s. `python`: another environment's interpreter (this repository on its path), e.g. one
    with another JAX and libtpu."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trial.json"
        # A fresh program cache (compile times are measured, never recalled), and no twin
        # compiles judging the flags (they would multiply the time of a row).
        xla = {**config.get("xla", {}), "judge": False}
        check = {"enabled": False, "cache_dir": tmp}
        path.write_text(json.dumps({**config, "xla": xla, "convergence": check}))
        start = time.time()
        command = [python or sys.executable, "-m", "trainer", "--config", str(path),
                   "--compile-only", "--target", target]  # fmt: skip
        env = {**os.environ, "PYTHONPATH": str(ROOT)} if python else None
        proc = subprocess.run(command, capture_output=True, text=True, env=env)
        wall = time.time() - start
    events = {
        e["event"]: e
        for e in (json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{"))
    }
    if not events:
        events["failure"] = {
            "failure_class": f"exit {proc.returncode}",
            "message": proc.stderr[-400:],
        }
    return events, wall


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--only", help="one case name")
    args = parser.parse_args()
    table = Table(
        title="real models compiled for TPU7x on this host (memory: compile; time/throughput: estimate)"
    )
    for col in (
        "model",
        "target",
        "status",
        "compile s",
        "wall s",
        "HBM/device GiB",
        "fits",
        "est step s",
        "est tok/s/chip",
        "bound",
        "AG / RS / AR / A2A / RA2A / CP",
    ):
        table.add_column(col, justify="right")
    for name, (target, config) in CASES.items():
        if args.only and name != args.only:
            continue
        events, wall = compile_trial(config, target)
        s, c, f = events.get("summary", {}), events.get("compiled", {}), events.get("failure", {})
        status = "ok" if s else f.get("failure_class", "no events")
        col = c.get("collectives", {})
        table.add_row(
            name,
            target,
            status,
            f"{c.get('compile_s', 0):.0f}",
            f"{wall:.0f}",
            f"{c.get('memory_per_device', {}).get('total_bytes', 0) / GIB:.1f}",
            str(s.get("fits", "-")),
            f"{s.get('est_step_time_s', 0):.3f}",
            f"{s.get('est_tokens_per_sec_per_chip', 0):,.0f}",
            s.get("bound", "-"),
            " / ".join(str(col.get(op, "-")) for op in COLLECTIVES),
        )
        if f:
            Console(stderr=True).print(
                f"{name}: {f.get('failure_class')}: {str(f.get('message'))[:400]}"
            )
    Console(width=200).print(table)


if __name__ == "__main__":
    main()
