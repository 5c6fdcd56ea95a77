"""Measured search efficiency: how many compiles each search needs to find a point within 2% of
the best, replayed against a recorded table in which every point of a space was compiled.

The table (benchmarks/data/search_table.csv) is every point of benchmarks/spaces/
search_table.yaml compiled for tpu7x:2x2x1 by libtpu on a CPU host (fidelity compile: memory
is the compiler's, tokens/s the step model's estimate from the compiled program). It was made
by

    sweeper run benchmarks/spaces/search_table.yaml --results-dir /tmp/stable
    python -m benchmarks.search_efficiency --build /tmp/stable/search_table/<SWEEP_ID>/summary.csv

A search "compiles" a point when it first asks for it (a point asked again is the engine's
reused result, no compile). Its cost is the number of compiles until one lands within
`--within` of the table's best (failed compiles count: they cost a compile too).

- random: Optuna's RandomSampler (the engine's `random`);
- tpe: Optuna's TPE as the engine configures it (`sweeper.search.make_sampler`), told as the
  engine tells it (an infeasible point: value 0 and a violated constraint);
- ladder: the ladder's order (sweeper/ladder.py): the screen's points that fit best-first,
  then those near the memory edge, then the rest; ties in the screen broken by the seed.

    python -m benchmarks.search_efficiency [--seeds 10] [--within 0.02]
"""

from __future__ import annotations

import argparse
import statistics
import warnings
from pathlib import Path
from typing import Any

import optuna
import pandas as pd

from sweeper.ladder import BY_EDGE, BY_RANK, choose
from sweeper.results import KNOB_PREFIX
from sweeper.screen import screen
from sweeper.search import make_sampler, to_distribution
from sweeper.space import Space, count_points, load_space

HERE = Path(__file__).resolve().parent
SPACE = HERE / "spaces" / "search_table.yaml"
TABLE = HERE / "data" / "search_table.csv"
METRIC = "est_tokens_per_sec_per_chip"
KEPT = ("status", "failure_class", METRIC, "hbm_per_device_gib", "fidelity", "hardware",
        "program_fingerprint")  # fmt: skip


def build(summary: Path, out: Path = TABLE) -> pd.DataFrame:
    """The recorded table from a sweep that compiled every point of the space."""
    frame = pd.read_csv(summary)
    knobs = [c for c in frame.columns if c.startswith(KNOB_PREFIX)]
    table = frame[[*knobs, *KEPT]].sort_values(knobs).reset_index(drop=True)
    table["failure_class"] = table["failure_class"].astype(object).fillna("").astype(str)
    # The space's memory budget, judged on the compiler's memory per device (as compile trials
    # judge it since the budget holds at compile fidelity; this table's compiles predate that).
    budget = load_space(SPACE).constraints.max_memory_per_device_gib
    if budget is not None:
        over = (table["status"] == "ok") & (table["hbm_per_device_gib"] > budget)
        table.loc[over, ["status", "failure_class"]] = ["failed", "oom_hbm"]
    points = len(table.drop_duplicates(knobs))
    expected = count_points(load_space(SPACE))
    if points != expected:
        raise SystemExit(f"{summary} holds {points} distinct points; the space has {expected}")
    out.parent.mkdir(parents=True, exist_ok=True)
    table.to_csv(out, index=False)
    return table


def _key(point: dict[str, Any], knobs: list[str]) -> tuple[str, ...]:
    return tuple(str(point[k]) for k in knobs)


class Replay:
    """The recorded table as a function of a point, and the target every search must reach."""

    def __init__(self, table: pd.DataFrame, within: float):
        self.knobs = [
            c.removeprefix(KNOB_PREFIX) for c in table.columns if c.startswith(KNOB_PREFIX)
        ]
        self.rows = {
            _key({k: row[f"{KNOB_PREFIX}{k}"] for k in self.knobs}, self.knobs): row
            for _, row in table.iterrows()
        }
        ok = table[table["status"] == "ok"]
        self.best = float(ok[METRIC].max())
        self.target = self.best * (1 - within)

    def row(self, point: dict[str, Any]) -> pd.Series:
        return self.rows[_key(point, self.knobs)]

    def hit(self, point: dict[str, Any]) -> bool:
        row = self.row(point)
        return row["status"] == "ok" and float(row[METRIC]) >= self.target

    def cost(self, order: list[dict[str, Any]]) -> int:
        """Compiles a search spends, in this order of distinct points, to reach the target."""
        for n, point in enumerate(order, 1):
            if self.hit(point):
                return n
        return len(order) + 1  # never reached: more than the space


def ladder_order(space: Space, seed: int) -> list[dict[str, Any]]:
    """The ladder's compile order: verify set first (best that fit, then the edge), then the
    rest of what fits and what lies near the edge, by the screen's figure; ties by the seed."""
    frame = screen(space)
    frame = frame.sample(frac=1, random_state=seed)  # shuffle ties, then a stable sort
    big = space.model_copy(
        update={"search": space.search.model_copy(
            update={"ladder": space.search.ladder.model_copy(update={"verify": len(frame)})})}  # type: ignore[union-attr]
    )  # fmt: skip
    chosen = choose(frame, big)
    tier = chosen["compiled_for"].map({BY_RANK: 0, BY_EDGE: 1}).fillna(2)
    chosen = chosen.assign(tier=tier, score=chosen[METRIC].fillna(-1.0))
    chosen = chosen.sort_values(["tier", "score"], ascending=[True, False], kind="stable")
    knobs = [c for c in chosen.columns if c.startswith(KNOB_PREFIX)]
    return [{c.removeprefix(KNOB_PREFIX): row[c] for c in knobs} for _, row in chosen.iterrows()]


def sampler_order(space: Space, replay: Replay, sampler: str, seed: int) -> list[dict[str, Any]]:
    """Distinct points in the order an Optuna sampler, told the table's results, asks them."""
    search = space.search.model_copy(
        update={"sampler": sampler, "seed": seed, "trials": len(replay.rows), "ladder": None}
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        study = optuna.create_study(
            direction="maximize", sampler=make_sampler(space.model_copy(update={"search": search}))
        )
    distributions = {k: to_distribution(space.knobs[k]) for k in replay.knobs}
    seen: dict[tuple[str, ...], float] = {}
    order: list[dict[str, Any]] = []
    asks = 0
    while len(seen) < len(replay.rows) and asks < 50 * len(replay.rows):
        asks += 1
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trial = study.ask(distributions)
        point = dict(trial.params)
        key = _key(point, replay.knobs)
        if key not in seen:
            order.append(point)
            if replay.hit(point):
                return order  # the rest does not change the cost
            row = replay.row(point)
            seen[key] = float(row[METRIC]) if row["status"] == "ok" else 0.0
        study.tell(trial, seen[key])
    return order


def measure(seeds: int, within: float, table_path: Path = TABLE) -> pd.DataFrame:
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    table = pd.read_csv(table_path)
    replay = Replay(table, within)
    space = load_space(SPACE, {"search.ladder": {"verify": 8}})
    rows = []
    for method in ("ladder", "tpe", "random"):
        costs = []
        for seed in range(seeds):
            if method == "ladder":
                order = ladder_order(space, seed)
            else:
                order = sampler_order(space, replay, method, seed)
            costs.append(replay.cost(order))
        rows.append({"search": method, "mean": statistics.mean(costs),
                     "stdev": statistics.stdev(costs) if len(costs) > 1 else 0.0,
                     "min": min(costs), "max": max(costs), "costs": costs})  # fmt: skip
    frame = pd.DataFrame(rows)
    frame["vs_random"] = frame["mean"] / frame.loc[frame["search"] == "random", "mean"].iloc[0]
    frame.attrs.update(points=len(replay.rows), ok=int((table["status"] == "ok").sum()),
                       best=replay.best, target=replay.target)  # fmt: skip
    return frame


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=10)
    parser.add_argument("--within", type=float, default=0.02)
    parser.add_argument("--build", type=Path, help="a summary.csv that compiled every point")
    args = parser.parse_args()
    if args.build:
        table = build(args.build)
        print(
            f"wrote {TABLE}: {len(table)} points, {(table['status'] == 'ok').sum()} compiled to fit"
        )
        return
    frame = measure(args.seeds, args.within)
    a = frame.attrs
    print(
        f"recorded table: {a['points']} points of {SPACE.name}, {a['ok']} compiled to fit; best "
        f"{METRIC} {a['best']:,.0f} (fidelity compile, TPU7x estimate); target within "
        f"{args.within:.0%}: {a['target']:,.0f}"
    )
    print(f"compiles to reach the target, over {args.seeds} seeds:")
    print(f"{'search':<8} {'mean':>6} {'stdev':>6} {'min':>4} {'max':>4} {'x random':>9}  per seed")
    for _, r in frame.iterrows():
        print(f"{r['search']:<8} {r['mean']:>6.1f} {r['stdev']:>6.1f} {r['min']:>4} {r['max']:>4} "
              f"{r['vs_random']:>9.2f}  {r['costs']}")  # fmt: skip


if __name__ == "__main__":
    main()
