"""Measured search efficiency: how many compiles each search needs to find a point within 2% of
the best, replayed against recorded tables in which every point of a space was compiled.

Each table (benchmarks/data/NAME.csv) is every point of benchmarks/spaces/NAME.yaml compiled
for tpu7x:2x2x1 by libtpu on a CPU host (fidelity compile: memory is the compiler's, tokens/s
the step model's estimate from the compiled program):

- search_table: a 4-layer d1024 model at 2k. Compiled on 2026-12-03; its tokens/s were
  remade at 2026-12-04's step model, which reads an unrolled loop's trip count from its
  counter's step (ae01a76): the tensor-1 programs' windowed-einsum rings had been counted
  twice over, 23 to 29% below what the compile now says. The tensor-1 rows were compiled
  again; the tensor-2 rows have no such loop and read the same. Compiled again, every point,
  on 2026-12-04 under libtpu 0.0.52 and the grid-step floor (sweep 20261204-100851-c7cc), and
  again once the step model read its SparseCore work (sweep 20261204-154820-5de4).
- search_table_b: a 4-layer d1536 model at 4k, held out: compiled after the screen's formula
  was last changed, and not read before the screen's predictions for it were committed
  (benchmarks/data/search_table_b_screen.csv). Compiled again, every point, on 2026-12-04
  under libtpu 0.0.52, once the step model read its SparseCore collectives (sweep
  20261204-123724-759b), read against those committed predictions (the memory estimate,
  and with it today's screen, was refitted on this table afterwards).

- search_table_c: a 4-layer d1280 model at 3k with a 50k vocabulary, held out from the
  memory estimate refitted on 2026-12-04 (fitted on the two tables above among others): its
  screen (search_table_c_screen.csv) was committed at 2dbee99, before any point was compiled.

- search_table_d: a 4-layer d1792 model at 2k with a 64k vocabulary, held out from the
  screen's step estimate fitted on 2026-12-04 (on the three tables above) and from the memory
  estimate: its screen (search_table_d_screen.csv) was committed at 01de8e4, before any
  point was compiled (sweep 20261204-175852-e03d).
- search_table_e: a 4-layer d2048 model at 1k with a 48k vocabulary, held out like
  search_table_d from the same screen: its screen (search_table_e_screen.csv) was committed
  at cc222c1, before any point was compiled (sweep 20261204-190257-c517).

- search_table_moe: a 4-layer MoE model (16 experts, top 4, tokamax's grouped matmuls) d1024
  at 2k, the first compiled MoE table, held out from the screen's MoE terms (whole expert
  tiles, the routing at the SparseCores' rate: shaped on the two qwen3 rows) and from the
  step constants (fitted on dense tables): its screen (search_table_moe_screen.csv) was
  committed before any point was compiled.

A held-out table's ladder reads its committed screen (and the report adds today's beside).

Each was made by

    sweeper run benchmarks/spaces/NAME.yaml --results-dir /tmp/NAME
    python -m benchmarks.search_efficiency --table NAME --build /tmp/NAME/NAME/<SWEEP_ID>/summary.csv

(`--build` takes several summaries; a later one's row replaces an earlier one's for the same
point: how search_table's tensor-1 rows were replaced by their recompiles.)

A search "compiles" a point when it first asks for it (a point asked again is the engine's
reused result, no compile). Its cost is the number of compiles until one lands within
`--within` of the table's best (failed compiles count: they cost a compile too).

- random: Optuna's RandomSampler (the engine's `random`);
- tpe: Optuna's TPE as the engine configures it (`sweeper.search.make_sampler`), told as the
  engine tells it (an infeasible point: value 0 and a violated constraint);
- ladder: the ladder's order as a sweep runs it (sweeper/ladder.py, verify 8): the screen's
  8 best that fit, then those near the memory edge that would rank among them, then the
  rest of what fits, then what the screen calls over the memory; ties broken by the seed;
- fits-first: every point the screen calls fitting, best first, before any near the edge
  (the ladder's order as replayed before 2026-12-04).

Beside each table: the screen's rank correlation (Spearman) with the compile over the points
both call fitting, and how many memory verdicts the compile overturned.

    python -m benchmarks.search_efficiency [--table NAME] [--seeds 10] [--within 0.02]
    python -m benchmarks.search_efficiency --table search_table_b --predict   # the screen's figures
"""

from __future__ import annotations

import argparse
import statistics
import warnings
from pathlib import Path
from typing import Any

import optuna
import pandas as pd

from sweeper.record.row import KNOB_PREFIX
from sweeper.search.distributions import make_sampler, to_distribution
from sweeper.search.ladder import BY_EDGE, BY_RANK, choose, typed_point
from sweeper.search.screen import FITS, OVER_HBM, screen
from sweeper.space.load import load_space
from sweeper.space.points import count_points
from sweeper.space.schema import Space

HERE = Path(__file__).resolve().parent
TABLES = (
    "search_table",
    "search_table_b",
    "search_table_c",
    "search_table_d",
    "search_table_e",
    "search_table_moe",
)


def space_path(name: str) -> Path:
    return HERE / "spaces" / f"{name}.yaml"


def table_path(name: str) -> Path:
    return HERE / "data" / f"{name}.csv"


def screen_path(name: str) -> Path:
    """The screen's figures for a held-out table, committed before any point was compiled."""
    return HERE / "data" / f"{name}_screen.csv"


METRIC = "est_tokens_per_sec_per_chip"
# trainer.trial.events.hbm_overflow's message, for summaries older than their `needed_gib`
# column: the compiler's memory of a program over budget.
OVER_BUDGET = r"compiled program needs ([0-9.]+) GiB per device"
KEPT = ("status", "failure_class", METRIC, "hbm_per_device_gib", "fidelity", "hardware",
        "program_fingerprint")  # fmt: skip


def build(summaries: list[Path], name: str) -> pd.DataFrame:
    """The recorded table from sweeps that compiled every point of the space between them (a
    later summary's row replaces an earlier one's for the same point)."""
    frames = [pd.read_csv(summary) for summary in summaries]
    knobs = [c for c in frames[0].columns if c.startswith(KNOB_PREFIX)]
    for f in frames:  # a compile over the space's budget: the memory its failure states
        if "needed_gib" in f:
            stated = f["needed_gib"]
        else:  # a summary from before that column: read from the failure's message
            stated = f["failure_message"].astype(str).str.extract(OVER_BUDGET)[0].astype(float)
        f["hbm_per_device_gib"] = f["hbm_per_device_gib"].fillna(stated)
    frame = pd.concat([f[[*knobs, *KEPT]] for f in frames], ignore_index=True)
    frame = frame[frame["status"].isin(["ok", "failed"])]  # a cut-off trial is no figure
    frame = frame.drop_duplicates(knobs, keep="last")
    table = frame.sort_values(knobs).reset_index(drop=True)
    table["failure_class"] = table["failure_class"].astype(object).fillna("").astype(str)
    # The space's memory budget, judged on the compiler's memory per device (as compile trials
    # judge it since the budget holds at compile fidelity; this table's compiles predate that).
    space = load_space(space_path(name))
    budget = space.constraints.max_memory_per_device_gib
    if budget is not None:
        over = (table["status"] == "ok") & (table["hbm_per_device_gib"] > budget)
        table.loc[over, ["status", "failure_class"]] = ["failed", "oom_hbm"]
    expected = count_points(space)
    if len(table) != expected:
        raise SystemExit(f"{summaries} hold {len(table)} distinct points; the space has {expected}")
    table_path(name).parent.mkdir(parents=True, exist_ok=True)
    table.to_csv(table_path(name), index=False)
    return table


def screened(name: str) -> pd.DataFrame:
    """The screen's verdict, memory, est. tokens/s and rank for every point of the space (the
    prediction a held-out table is read against)."""
    frame = screen(load_space(space_path(name)))
    knobs = [c for c in frame.columns if c.startswith(KNOB_PREFIX)]
    kept = [*knobs, "verdict", "est_hbm_per_device_gib", METRIC, "rank"]
    return frame[kept].sort_values(knobs).reset_index(drop=True)


def on_knobs(
    left: pd.DataFrame, right: pd.DataFrame, how: str = "inner", suffixes=("", "_screen")
) -> pd.DataFrame:
    """`left`'s points joined with `right`'s figures for the same point: matched on the knob
    columns as text (a table read from CSV and a screen typed by the space spell a value
    alike only as text)."""
    knobs = [c for c in left.columns if c.startswith(KNOB_PREFIX)]
    as_text = dict.fromkeys(knobs, str)
    return left.astype(as_text).merge(right.astype(as_text), on=knobs, how=how, suffixes=suffixes)


def agreement(name: str, table: pd.DataFrame, today: bool = False) -> dict[str, float]:
    """The screen (a held-out table's committed one, unless `today`) against the compile:
    Spearman over the points both call fitting, and the memory verdicts the compile
    overturned."""
    committed = None if today else frozen_screen(name)
    predicted = screened(name) if committed is None else committed
    both = on_knobs(table, predicted)
    fits = both["status"] == "ok"
    said_fits = both["verdict"] == "fits"
    pair = both[fits & said_fits]
    return {
        "spearman": float(pair[METRIC].rank().corr(pair[f"{METRIC}_screen"].rank())),
        "pairs": len(pair),
        "memory_spearman": float(
            both["hbm_per_device_gib"].rank().corr(both["est_hbm_per_device_gib"].rank())
        ),
        "verdicts_agree": int((fits == said_fits).sum()),
        "points": len(both),
    }


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


def ladder_order(
    space: Space, seed: int, frame: pd.DataFrame | None = None, fits_first: bool = False
) -> list[dict[str, Any]]:
    """The ladder's compile order, as a sweep runs it: its verify rung (the space's `verify`
    best that fit by the screen, then the points near the memory edge whose est. tokens/s
    would place them among those), then the rest of what fits, then what the screen calls
    over the memory, each by the screen's figure, then the invalid; ties by the seed.
    `fits_first`: every point the screen calls fitting before any near the edge (the order
    replayed before 2026-12-04).
    The screen is today's, or `frame`: the one committed for a held-out table."""
    frame = screen(space) if frame is None else frame
    frame = frame.sample(frac=1, random_state=seed)  # shuffle ties, then a stable sort
    if fits_first:
        space = space.model_copy(
            update={"search": space.search.model_copy(
                update={"ladder": space.search.ladder.model_copy(update={"verify": len(frame)})})}  # type: ignore[union-attr]
        )  # fmt: skip
    chosen = choose(frame, space)
    rest = chosen["verdict"].map({FITS: 2, OVER_HBM: 3}).fillna(4)
    tier = chosen["compiled_for"].map({BY_RANK: 0, BY_EDGE: 1}).fillna(rest)
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


def frozen_screen(name: str) -> pd.DataFrame | None:
    """A held-out table's committed screen, its knob values typed as the space's (or None)."""
    if not screen_path(name).exists():
        return None
    frame = pd.read_csv(screen_path(name))
    space = load_space(space_path(name))
    knobs = [c for c in frame.columns if c.startswith(KNOB_PREFIX)]
    for i, row in frame.iterrows():
        for knob, value in typed_point(space, row[knobs]).items():
            frame.at[i, f"{KNOB_PREFIX}{knob}"] = value
    return frame


SEARCHES = ("ladder", "fits-first", "tpe", "random")


def measure(
    seeds: int,
    within: float,
    name: str = "search_table",
    today: bool = False,
    searches: tuple[str, ...] = SEARCHES,
) -> pd.DataFrame:
    """Each of `searches`' compiles to the target over `seeds` seeds (`vs_random` where
    random is among them). The ladder reads a held-out table's committed screen, or today's
    screen with `today` (or for a table without one)."""
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    table = pd.read_csv(table_path(name))
    replay = Replay(table, within)
    space = load_space(space_path(name), {"search.ladder": {"verify": 8}})
    committed = None if today else frozen_screen(name)
    rows = []
    for method in searches:
        costs = []
        for seed in range(seeds):
            if method in ("ladder", "fits-first"):
                order = ladder_order(space, seed, committed, fits_first=method == "fits-first")
            else:
                order = sampler_order(space, replay, method, seed)
            costs.append(replay.cost(order))
        rows.append({"search": method, "mean": statistics.mean(costs),
                     "stdev": statistics.stdev(costs) if len(costs) > 1 else 0.0,
                     "min": min(costs), "max": max(costs), "costs": costs})  # fmt: skip
    frame = pd.DataFrame(rows)
    if "random" in searches:
        frame["vs_random"] = frame["mean"] / frame.loc[frame["search"] == "random", "mean"].iloc[0]
    frame.attrs.update(points=len(replay.rows), ok=int((table["status"] == "ok").sum()),
                       best=replay.best, target=replay.target,
                       screen="committed" if committed is not None else "today's")  # fmt: skip
    return frame


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--table", choices=TABLES, action="append",
                        help="a recorded table (default: each)")  # fmt: skip
    parser.add_argument("--seeds", type=int, default=10)
    parser.add_argument("--within", type=float, default=0.02)
    parser.add_argument("--build", type=Path, nargs="+", help="summary.csv files that compiled "
                        "every point between them")  # fmt: skip
    parser.add_argument("--predict", action="store_true",
                        help="write the screen's figures for the table's space, to commit "
                        "before the table is read")  # fmt: skip
    args = parser.parse_args()
    names = args.table or list(TABLES)
    if args.build or args.predict:
        if len(names) != 1:
            raise SystemExit("--build and --predict take one --table")
        if args.predict:
            out = screen_path(names[0])
            if out.exists():
                raise SystemExit(f"{out} is committed: a held-out table's screen is made once")
            screened(names[0]).to_csv(out, index=False)
            print(f"wrote {out}")
            return
        table = build(args.build, names[0])
        print(f"wrote {table_path(names[0])}: {len(table)} points, "
              f"{(table['status'] == 'ok').sum()} compiled to fit")  # fmt: skip
        return
    for name in names:
        if not table_path(name).exists():
            print(f"\n{name}: no recorded table yet ({table_path(name)}; --build makes it)")
            continue
        report(name, args.seeds, args.within)


def report(name: str, seeds: int, within: float) -> None:
    frame = measure(seeds, within, name)
    a = frame.attrs
    print(
        f"\n{name}: {a['points']} points of {space_path(name).name}, {a['ok']} compiled to fit; "
        f"best {METRIC} {a['best']:,.0f} (fidelity compile, TPU7x estimate); target within "
        f"{within:.0%}: {a['target']:,.0f}"
    )
    print(f"compiles to reach the target, over {seeds} seeds (the ladder on {a['screen']} screen):")
    print(
        f"{'search':<10} {'mean':>6} {'stdev':>6} {'min':>4} {'max':>4} {'x random':>9}  per seed"
    )
    for _, r in frame.iterrows():
        print(f"{r['search']:<10} {r['mean']:>6.1f} {r['stdev']:>6.1f} {r['min']:>4} {r['max']:>4} "
              f"{r['vs_random']:>9.2f}  {r['costs']}")  # fmt: skip
    table = pd.read_csv(table_path(name))
    _agreement_line(f"{a['screen']} screen", agreement(name, table))
    if a["screen"] == "committed":  # the same table read by today's screen (fitted since?)
        ladder = measure(seeds, within, name, today=True, searches=("ladder",)).iloc[0]
        random = frame.loc[frame["search"] == "random", "mean"].iloc[0]
        print(f"today's screen: ladder {ladder['mean']:.1f} compiles ({ladder['mean'] / random:.2f}x "
              f"random) {ladder['costs']}")  # fmt: skip
        _agreement_line("today's screen", agreement(name, table, today=True))


def _agreement_line(label: str, g: dict[str, float]) -> None:
    print(f"{label} against compile: Spearman {g['spearman']:+.2f} over the {g['pairs']} points "
          f"both call fitting; memory Spearman {g['memory_spearman']:+.2f}; memory verdicts agree "
          f"on {g['verdicts_agree']} of {g['points']}")  # fmt: skip


if __name__ == "__main__":
    main()
