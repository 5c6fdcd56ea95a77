"""bf16 versus fp8 (qwix) on CPU: loss parity is the finding; step time is shown, not a finding.

    python -m benchmarks.fp8_parity [--steps 60] [--model small-dense]

XLA on CPU upcasts fp8 operands to f32 before the dot, so fp8 steps are slower here than
bf16; on TPU7x fp8 doubles peak FLOPs. What this run can establish is numerics: the final
loss (mean of the last 10 steps) of each fp8 variant against bf16 on the same data and
seed. Fidelity: run, this host's CPU, one device.
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np
from rich.console import Console
from rich.table import Table

from trainer.run.train import train
from trainer.trial.config import load_config
from trainer.trial.events import Emitter

VARIANTS = {
    "bf16": {},
    "fp8 per-tensor dynamic": {"mode": "fp8"},
    "fp8 per-axis dynamic": {"mode": "fp8", "granularity": "per_axis"},
    "fp8 per-tensor static": {"mode": "fp8", "scaling": "static"},
    "fp8 fixed ±224": {"mode": "fp8", "scaling": "fixed"},
}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--model", default="small-dense")
    args = parser.parse_args()
    table = Table(
        title=f"bf16 vs fp8, {args.model}, {args.steps} steps (fidelity run, CPU: fp8 is emulated)"
    )
    for col in (
        "variant",
        "final loss",
        "vs bf16",
        "step median s",
        "step time vs bf16 (CPU, not a finding)",
    ):
        table.add_column(col, justify="right")
    base = None
    for name, precision in VARIANTS.items():
        config = load_config(
            {
                "model": {"preset": args.model},
                "seq_len": 128,
                "per_device_batch": 8,
                "steps": args.steps,
                "learning_rate": 3e-3,
                "num_devices": 1,
                "mesh": {"fsdp": 1},
                "backend": "cpu",
                "precision": precision,
                "convergence": {"enabled": False},
            }
        )
        result = train(config, Emitter(quiet=True))
        final = float(np.mean(result.losses[-10:]))
        step = result.summary["step_time_median_s"]
        base = base or (final, step)
        table.add_row(
            name,
            f"{final:.4f}",
            f"{final / base[0] - 1:+.2%}",
            f"{step:.4f}",
            f"{step / base[1]:.2f}x",
        )
    Console(width=160).print(table)


if __name__ == "__main__":
    main()
