"""Seed-to-seed spread of the final loss against what a recipe change moves it by.

    python -m benchmarks.convergence_noise [--steps 40]

The smoke recipe (tiny-dense, 8 simulated CPU devices): seeds 0-2, the learning rate
halved, and a resharded run (tensor 2), each trained by the real trainer in a child
process. The final loss is the mean of the last 5 steps, as the convergence check takes
it. Fidelity: run, on this host's CPU; the ratios, not the speed, are the finding.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from rich.console import Console
from rich.table import Table

BASE = {"model": {"preset": "tiny-dense"}, "seq_len": 64, "per_device_batch": 1,
        "learning_rate": 0.01, "backend": "cpu", "convergence": {"enabled": False}}  # fmt: skip
CASES = {
    "seed 0 (reference)": {"seed": 0},
    "seed 1": {"seed": 1},
    "seed 2": {"seed": 2},
    "init seed 1 (data fixed)": {"seed": 0, "init_seed": 1},
    "init seed 2 (data fixed)": {"seed": 0, "init_seed": 2},
    "learning rate halved": {"seed": 0, "learning_rate": 0.005},
    "resharded (tensor 2)": {"seed": 0, "mesh": {"tensor": 2}},
}


def final_loss(config: dict, workdir: Path) -> float:
    path = workdir / "trial.json"
    path.write_text(json.dumps(config))
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}  # fmt: skip
    out = subprocess.run([sys.executable, "-m", "trainer", "--config", str(path)],
                         capture_output=True, text=True, env=env, check=True).stdout  # fmt: skip
    losses = [e["loss"] for e in map(json.loads, filter(None, out.splitlines()))
              if e.get("event") == "step"]  # fmt: skip
    return sum(losses[-5:]) / len(losses[-5:])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()
    table = Table(title=f"final loss (mean of last 5 of {args.steps} steps), smoke recipe, CPU")
    for column in ("run", "final loss", "vs seed 0"):
        table.add_column(column)
    with tempfile.TemporaryDirectory() as tmp:
        finals = {name: final_loss({**BASE, "steps": args.steps, **change}, Path(tmp))
                  for name, change in CASES.items()}  # fmt: skip
    reference = finals["seed 0 (reference)"]
    for name, value in finals.items():
        table.add_row(name, f"{value:.4f}", f"{(value - reference) / reference:+.2%}")
    Console().print(table)


if __name__ == "__main__":
    main()
