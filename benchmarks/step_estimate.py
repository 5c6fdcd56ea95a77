"""The screen's step estimate (trainer/estimate/analytic.py: `estimate`, fidelity estimate)
against the step model read from each compiled program (fidelity compile, libtpu on this CPU
host) over every point of the compiled search tables: the error in est. tokens/s and the
rank correlation, per table.

    python -m benchmarks.step_estimate           # the table, by today's constants
    python -m benchmarks.step_estimate --fit     # the constants that fit the fit tables best

Tables, by what the constants saw (benchmarks/search_efficiency.py says how each was made):
- fit: search_table, search_table_b and search_table_c, all compiled before the constants
  were fitted (2026-12-04);
- held out: the tables in HELD_OUT, whose screen (benchmarks/data/NAME_screen.csv, with
  these constants) was committed before any point of them was compiled.

Beside them, the screen against the published Ironwood rows (benchmarks/calibration.py's
PUBLISHED: measured on TPU7x, fidelity run): none of them shaped the seven constants; the
step model's two MXU efficiencies the screen borrows were fitted on the two 70B 64-chip rows.
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

import pandas as pd
from scipy.optimize import nnls
from scipy.stats import spearmanr

from benchmarks.calibration import FIT as CALIBRATION_FIT
from benchmarks.calibration import PUBLISHED, recipe
from benchmarks.search_efficiency import (
    METRIC,
    frozen_screen,
    on_knobs,
    space_path,
    table_path,
)
from sweeper.record.row import KNOB_PREFIX
from sweeper.search.ladder import typed_point
from sweeper.space.checks import static_check
from sweeper.space.load import load_space
from trainer.estimate import analytic
from trainer.trial.checks import global_batch_size
from trainer.trial.config import load_config
from trainer.trial.hardware import Topology

FIT = ("search_table", "search_table_b", "search_table_c")
HELD_OUT: tuple[str, ...] = ("search_table_d", "search_table_e", "search_table_moe")
# not fitted: the MXU efficiencies, the update's bytes, the routing at the SparseCores' rate
FIXED = ("compute", "update", "routing")


def points(name: str) -> pd.DataFrame:
    """Each compiled point of a table that fits: its knobs, the compile's step (from its
    tokens/s) and the screen's terms at a constant of 1."""
    space = load_space(space_path(name))
    topology = space.target.tpu
    table = pd.read_csv(table_path(name))
    table = table[table["status"] == "ok"].reset_index(drop=True)
    rows = []
    for _, row in table.iterrows():
        config = static_check(space, typed_point(space, row), topology.devices)
        batch = global_batch_size(config, topology.devices)
        chips = topology.devices / topology.accelerator.devices_per_chip
        tokens = batch * config.seq_len
        terms = analytic.step_terms(config, topology.accelerator, topology.devices, batch)
        estimated = analytic.estimate(config, topology.accelerator, topology.devices)
        rows.append({
            **{k: row[k] for k in table.columns if k.startswith(KNOB_PREFIX)},
            "table": name,
            "compiled": row[METRIC],
            "step": tokens / row[METRIC] / chips,
            "screen": estimated[METRIC],
            **terms,
        })  # fmt: skip
    return pd.DataFrame(rows)


def fit(frame: pd.DataFrame) -> dict[str, float]:
    """Non-negative least squares of the fitted terms' constants on the step, each point by
    its relative error (the fixed terms at 1)."""
    fitted = [k for k in analytic.STEP_CONSTANTS]
    weight = 1 / frame["step"].to_numpy()
    rest = frame["step"].to_numpy() - frame[list(FIXED)].sum(axis=1).to_numpy()
    coef, _ = nnls(frame[fitted].to_numpy() * weight[:, None], rest * weight)
    return {k: round(float(c), 3) for k, c in zip(fitted, coef, strict=True)}


def summary(frame: pd.DataFrame, screen: pd.Series) -> dict[str, Any]:
    error = screen / frame["compiled"] - 1
    best = frame["compiled"].idxmax()
    ranks = screen.rank(ascending=False)
    return {
        "points": len(frame),
        "median |error|": statistics.median(error.abs()),
        "max |error|": error.abs().max(),
        "spearman": spearmanr(frame["compiled"], screen).statistic,
        "best's screen rank": int(ranks[best]),
    }


def committed_screen(name: str, frame: pd.DataFrame) -> pd.Series:
    """A held-out table's committed screen figures for `frame`'s points, in its order."""
    frozen = frozen_screen(name)
    if frozen is None:
        raise SystemExit(f"{name} is held out but has no committed screen")
    knobs = [c for c in frame.columns if c.startswith(KNOB_PREFIX)]
    return on_knobs(frame[knobs], frozen, how="left")[METRIC]


def published() -> pd.DataFrame:
    """The screen's est. tokens/s per chip for each published recipe, against the published
    figure (measured on TPU7x)."""
    rows = []
    for name, row in PUBLISHED.items():
        config, target = recipe(name)
        topology = Topology.parse(target)
        est = analytic.estimate(load_config(config), topology.accelerator, topology.devices)
        rows.append({
            "row": name,
            "MXU efficiencies fitted on it": name in CALIBRATION_FIT,
            "published": row[4],
            "screen": est[METRIC],
            "error": est[METRIC] / row[4] - 1,
        })  # fmt: skip
    return pd.DataFrame(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fit", action="store_true")
    args = parser.parse_args()
    frames = {name: points(name) for name in FIT if table_path(name).exists()}
    if args.fit:
        constants = fit(pd.concat(frames.values(), ignore_index=True))
        print("STEP_CONSTANTS fitted on", ", ".join(frames), constants)
        return
    print("screen's est. tokens/s against the compile's, every point that compiled and fits")
    lines = []
    for name, frame in frames.items():
        lines.append(("fit", name, summary(frame, frame["screen"])))
    for name in HELD_OUT:
        if not table_path(name).exists():
            print(f"held out {name}: not compiled yet")
            continue
        frame = points(name)
        committed = committed_screen(name, frame)
        lines.append(("held out (committed screen)", name, summary(frame, committed)))
        lines.append(("held out (today's screen)", name, summary(frame, frame["screen"])))
    table = pd.DataFrame([{"split": s, "table": n, **v} for s, n, v in lines])
    print(table.to_string(index=False, float_format=lambda v: f"{v:.3f}"))
    print("constants:", analytic.STEP_CONSTANTS)
    print("\nscreen against the published Ironwood rows (fidelity run, TPU7x):")
    rows = published()
    print(rows.to_string(index=False, float_format=lambda v: f"{v:,.3f}"))
    dense = rows[~rows["row"].str.startswith("qwen3")]
    print(f"median |error|, dense rows: {dense['error'].abs().median():.1%} over {len(dense)}; "
          f"MoE rows: {rows.loc[~rows.index.isin(dense.index), 'error'].abs().median():.1%} "
          "(seen before the screen's routing term was added)")  # fmt: skip


if __name__ == "__main__":
    main()
