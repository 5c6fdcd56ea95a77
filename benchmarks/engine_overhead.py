"""Engine overhead: sweep wall time versus the trials' own training time, in one run.

    python -m benchmarks.engine_overhead [--trials 3] [--steps 700]

Runs the smoke space sequentially (concurrency 1) with long trials, and prints the
sweep's wall time against two sums: the trials' training loops (`train_s`, measured
inside the trainer) and the trainer processes' whole lives (`trainer_wall_s`: Python and
JAX start-up, compilation, training). The first ratio is everything a sweep adds to
training; the second is what the engine itself adds (Ray, scheduling, MLflow, process
management). Also the time from launch to the first trial's first step.
Fidelity: run, this host's CPU; the finding is the engine's overhead, not a speed.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import ray
from ray import tune
from rich.console import Console
from rich.table import Table

from sweeper.sweep.run import run_sweep


class FirstStep(tune.Callback):
    def __init__(self):
        self.first_step_at: float | None = None

    def on_trial_result(self, iteration, trials, trial, result, **info):
        if self.first_step_at is None and result.get("trial_status") == "running":
            self.first_step_at = time.time()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument(
        "--steps", type=int, default=700, help="about 30 s of training per trial on a 2-core host"
    )
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        launched = time.time()
        ray.init(
            address="local", include_dashboard=False, log_to_driver=False, logging_level="ERROR"
        )
        first = FirstStep()
        result = run_sweep(
            "smoke",
            results_dir=Path(tmp),
            trials=args.trials,
            concurrency=1,
            callbacks=[first],
            set={
                "trial.steps": args.steps,
                "constraints.convergence": False,
                "search.trial_timeout_s": 3600,
            },
        )
        wall = time.time() - launched
        ray.shutdown()
    frame = result.trials
    train = float(frame["train_s"].sum())
    trainer_wall = float(frame["trainer_wall_s"].sum())
    table = Table(title="engine overhead (fidelity run, local CPU; concurrency 1)")
    columns = (
        "trials",
        "steps/trial",
        "sweep wall s",
        "sum train loops s",
        "sum trainer processes s",
        "sweep / train loops",
        "sweep / trainer processes",
        "launch -> first step s",
    )
    for col in columns:
        table.add_column(col, justify="right")
    table.add_row(
        str(len(frame)),
        str(args.steps),
        f"{wall:.1f}",
        f"{train:.1f}",
        f"{trainer_wall:.1f}",
        f"+{wall / train - 1:.1%}",
        f"+{wall / trainer_wall - 1:.1%}",
        f"{first.first_step_at - launched:.1f}" if first.first_step_at else "-",
    )
    Console(width=200).print(table)


if __name__ == "__main__":
    main()
