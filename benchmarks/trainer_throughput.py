"""Trainer tokens/sec versus a bare pure-JAX loop of the same model, measured side by side.

    python -m benchmarks.trainer_throughput [--steps 20] [--models tiny-dense,tiny-moe,small-dense]

Both run on one CPU device in this process with the same parameters, batch and remat
(`full`), so they do the same FLOPs; the table's ratio is the trainer's overhead.
Fidelity: run, on this host's CPU. CPU speed says nothing about TPU speed; the ratio is
what this measures.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import numpy as np
from rich.console import Console
from rich.table import Table

from benchmarks.bare_loop import make_step
from trainer.program.step import make_optimizer
from trainer.run.data import BatchSource
from trainer.run.train import train
from trainer.trial.config import load_config
from trainer.trial.events import Emitter

SHAPES = {
    "tiny-dense": (8, 128),
    "tiny-moe": (8, 128),
    "small-dense": (4, 256),
    "small-moe": (4, 256),
}


def trial(model: str, steps: int) -> dict:
    batch, seq = SHAPES[model]
    return {
        "model": {"preset": model},
        "seq_len": seq,
        "per_device_batch": batch,
        "steps": steps,
        "num_devices": 1,
        "mesh": {"fsdp": 1},
        "backend": "cpu",
        "measure": {"skip_steps": 3},
        "convergence": {"enabled": False},
    }


def bare_median_step_s(config, steps: int, skip: int) -> float:
    """The same model and batches through the hand-written loop."""
    from trainer.program.build import build_program

    program = build_program(config, jax.devices("cpu")[:1])
    state = program.init_fn(jax.random.key(config.seed))
    params, opt_state = state.params, state.opt_state
    step = make_step(config.model, make_optimizer(config))
    source = BatchSource(config, program.global_batch, 1)
    times = []
    for i in range(steps):
        b = source.batch(i)
        arrays = [jax.device_put(a) for a in (b.inputs_BxS, b.targets_BxS, b.positions_BxS)]
        start = time.perf_counter()
        params, opt_state, loss = step(params, opt_state, *arrays)
        jax.block_until_ready((params, opt_state, loss))
        if i >= skip:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--models", default="tiny-dense,tiny-moe,small-dense")
    parser.add_argument("--repeats", type=int, default=2, help="alternating repeats of each side")
    args = parser.parse_args()

    table = Table(
        title="trainer vs bare pure-JAX loop (fidelity: run, 1 CPU device; ratio is the finding)"
    )
    for col in ("model", "tokens/step", "trainer tok/s", "bare tok/s", "trainer / bare"):
        table.add_column(col, justify="right")
    for model in args.models.split(","):
        config = load_config(trial(model, args.steps))
        tokens = SHAPES[model][0] * SHAPES[model][1]
        trainer_s, bare_s = [], []
        for _ in range(args.repeats):  # alternate so drift on the host hits both sides
            summary = train(config, Emitter(quiet=True)).summary
            trainer_s.append(summary["step_time_median_s"])
            bare_s.append(bare_median_step_s(config, args.steps, config.measure.skip_steps))
        t, b = float(np.median(trainer_s)), float(np.median(bare_s))
        table.add_row(
            model, str(tokens), f"{tokens / t:,.0f}", f"{tokens / b:,.0f}", f"{b / t:.3f}"
        )
    Console().print(table)


if __name__ == "__main__":
    main()
