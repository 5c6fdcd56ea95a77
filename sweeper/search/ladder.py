"""The ladder (`search.ladder`): an answer bought at three prices, in order. Every point of the
space is screened by the analytic estimate in this process (sweeper/screen.py); the best that
fit, and those the estimate puts near the memory edge, are compiled for the target (the
verify rung: a compile-fidelity sweep of exactly those points, after the space's warm start,
the command it was imported from, as the baseline); the best compiled points are
written as a run-fidelity space for the target's slices (the run rung).

Each point keeps its verdict and rank at each rung: `screen.csv` (every screened point),
`ladder.csv` (the same, with its compile), summary.csv's `screen_*`/`verify_rank` columns,
tags on the trial's MLflow run, and the rank correlation between the rungs.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pandas as pd
import yaml

from sweeper.record.manifest import sweeper_command
from sweeper.record.row import KNOB_PREFIX, Column, knob_columns, missing
from sweeper.search.screen import (
    FITS,
    OVER_HBM,
    memory_limit_gib,
    screen,
    unseen_knobs,
    verdict_counts,
)
from sweeper.space.errors import SpaceError
from sweeper.space.fidelity import with_fidelity
from sweeper.space.points import assemble, counted, first_point
from sweeper.space.schema import Space
from trainer.trial.config import load_config
from trainer.trial.events import TrialStatus

SCREEN_CSV = "screen.csv"
LADDER_CSV = "ladder.csv"
RUN_RUNG = "run_rung.yaml"
# The space as its user wrote it (the verify rung's is rewritten): the run rung starts from it.
LADDER_SPACE = "ladder_space.yaml"
# Why a screened point was compiled: the screen's rank, its memory edge, or the space's own
# warm start (the command the user came with: what the verify rung's best is measured against).
BY_RANK, BY_EDGE, BY_START = "rank", "edge", "warm start"
# How far from the HBM limit, either side, the estimate's memory verdict is doubted (the
# verify rung compiles a fast point there) unless the space sets search.ladder.edge: the
# estimate's memory error as measured for the model's kind (docs/search.md). Dense: held-out
# dense points mostly within 10% (the held-out tables' largest 11.2%). Mixture-of-experts:
# the held-out MoE table reads up to 32.4% high, and deepseek-v3's published recipe, which
# ran, 30% (116.2 GiB a device by the estimate, 89.39 compiled).
EDGE = {"dense": 0.1, "moe": 0.35}
# The screen's columns carried into summary.csv, under these names.
SCREEN_COLUMNS = {
    "verdict": "screen_verdict",
    "rank": "screen_rank",
    "est_tokens_per_sec_per_chip": "screen_est_tokens_per_sec_per_chip",
    "est_hbm_per_device_gib": "screen_est_hbm_per_device_gib",
    "compiled_for": "screen_compiled_for",
}


def edge(space: Space) -> float:
    """The ladder's memory edge: the space's `search.ladder.edge`, else EDGE for its model."""
    ladder = space.search.ladder
    if ladder is not None and ladder.edge is not None:
        return ladder.edge
    model = load_config(assemble(space, first_point(space))).model
    return EDGE["moe" if model.is_moe else "dense"]


def choose(frame: pd.DataFrame, space: Space) -> pd.DataFrame:
    """The screened frame with `compiled_for` set on the points the verify rung compiles: the
    `verify` best that fit (rank), and up to as many near the memory edge whose est. tokens/s
    would place them among those (edge). Each a distinct estimated point: of points that
    differ only in knobs the screen cannot tell apart (`unseen_knobs`), the first screened;
    the verify rung's TPE trials explore those knobs."""
    ladder = space.search.ladder
    assert ladder is not None
    frame = frame.copy()
    frame["compiled_for"] = ""
    unseen = {f"{KNOB_PREFIX}{k}" for k in unseen_knobs(frame)}
    seen = [c for c in frame.columns if c.startswith(KNOB_PREFIX) and c not in unseen]
    distinct = ~frame[seen].astype(str).duplicated() if unseen and seen else True
    fits = frame[(frame["verdict"] == FITS) & distinct].sort_values("rank").head(ladder.verify)
    frame.loc[fits.index, "compiled_for"] = BY_RANK
    bar = fits["est_tokens_per_sec_per_chip"].min() if len(fits) == ladder.verify else -math.inf
    limit = memory_limit_gib(space)
    near = frame[
        frame["verdict"].isin([FITS, OVER_HBM])
        & distinct
        & (frame["compiled_for"] == "")
        & (
            (frame.get("est_hbm_per_device_gib", pd.Series(dtype=float)) / limit - 1).abs()
            <= edge(space)
        )
        & (frame.get("est_tokens_per_sec_per_chip", pd.Series(dtype=float)) >= bar)
    ]
    near = near.sort_values("est_tokens_per_sec_per_chip", ascending=False).head(ladder.verify)
    frame.loc[near.index, "compiled_for"] = BY_EDGE
    return frame


def typed_point(space: Space, row: pd.Series) -> dict[str, Any]:
    """A screened row's knob values as the space's knobs hold them (a table turns 2048 into
    2048.0 where a column has gaps, and a CSV turns every value into text)."""
    point = {}
    for column, cell in row.items():
        name = str(column).removeprefix(KNOB_PREFIX)
        if not str(column).startswith(KNOB_PREFIX) or missing(cell) or cell == "":
            continue
        knob = space.knobs[name]
        if knob.values is not None:
            point[name] = next(v for v in knob.values if str(v) == str(cell) or _same(v, cell))
        else:
            point[name] = int(float(cell)) if knob.kind == "int" else float(cell)
    return point


def _same(value: Any, cell: Any) -> bool:
    try:
        return not isinstance(value, (bool, str)) and float(value) == float(cell)
    except (TypeError, ValueError):
        return False


def verify_rung(space: Space) -> tuple[Space, pd.DataFrame]:
    """Screen the space; return the verify rung's compile sweep (its trials the space's warm
    start, then the chosen points in screen order) and the screened frame. SpaceError when
    nothing is worth compiling."""
    ladder = space.search.ladder
    assert ladder is not None
    frame = choose(screen(space, sample=ladder.screen, seed=space.search.seed), space)
    chosen = frame[frame["compiled_for"] != ""]
    starts = [dict(p) for p in space.search.warm_start]
    if chosen.empty and not starts:
        raise SpaceError(
            f"no screened point fits the target or lies near its memory edge "
            f"({verdict_counts(frame)}): "
            "widen the knobs, raise search.ladder.edge or pick a larger target",
            field="search.ladder",
        )
    frame = _mark_starts(frame, starts)
    picked = [typed_point(space, row) for _, row in chosen.iterrows()]
    warm = starts + [p for p in picked if not any(_within(s, p) for s in starts)]
    data = space.model_dump(mode="json")
    data[Column.FIDELITY] = "compile"
    data["search"].update(sampler="random", trials=len(warm), startup_trials=None,
                          warm_start=warm)  # fmt: skip
    unseen = [k for k in unseen_knobs(frame) if space.knobs[k].values is not None]
    if unseen:  # what the screen cannot tell apart, TPE explores by compile
        data["knobs"] = _among_chosen(space, warm, unseen)
        data["search"].update(sampler="tpe", trials=len(warm) + ladder.verify)
    return Space.model_validate(data), frame


def _within(start: dict[str, Any], point: dict[str, Any]) -> bool:
    """Whether `point` takes every value the warm-start point `start` sets."""
    return all(_text(point.get(k)) == _text(v) for k, v in start.items())


def _mark_starts(frame: pd.DataFrame, starts: list[dict[str, Any]]) -> pd.DataFrame:
    """The frame with the warm start's points (those the screen did not pick already) marked
    `compiled_for` BY_START: the verify rung compiles them first."""
    frame = frame.copy()
    for start in starts:
        same = pd.Series(True, index=frame.index)
        for name, value in start.items():
            column = frame.get(f"{KNOB_PREFIX}{name}")
            cells = column.map(_text) if column is not None else pd.Series("", index=frame.index)
            same &= cells == _text(value)
        frame.loc[same & (frame["compiled_for"] == ""), "compiled_for"] = BY_START
    return frame


def _among_chosen(space: Space, warm: list[dict[str, Any]], unseen: list[str]) -> dict[str, Any]:
    """The space's knobs for the verify rung's TPE trials: each knob the screen judged held to
    the values its chosen points take (what it cannot judge keeps all of its own)."""
    knobs: dict[str, Any] = space.model_dump(mode="json")["knobs"]
    for name, knob in space.knobs.items():
        if name in unseen or knob.values is None:
            continue
        taken = {repr(p[name]) for p in warm if name in p}
        knobs[name]["values"] = [v for v in knob.values if repr(v) in taken] or knob.values[:1]
    return knobs


def write_screen(sweep_dir: Path, frame: pd.DataFrame, space: Space) -> None:
    """The screen's every point, and the space as written (the run rung starts from it)."""
    frame.to_csv(sweep_dir / SCREEN_CSV, index=False)
    (sweep_dir / LADDER_SPACE).write_text(
        yaml.safe_dump(space.model_dump(mode="json"), sort_keys=False)
    )


def _key(row: pd.Series, knobs: list[str]) -> tuple[str, ...]:
    return tuple(_text(row.get(k)) for k in knobs)


def _text(cell: Any) -> str:
    if missing(cell) or cell == "":
        return ""
    if isinstance(cell, float) and cell.is_integer():
        return str(int(cell))
    return str(cell)


def verified(
    frame: pd.DataFrame, sweep_dir: Path, space: Space
) -> tuple[pd.DataFrame, list[str], dict[str, float]]:
    """The verify rung's results joined to its screen: the summary frame with `screen_*` and
    `verify_rank` columns, notes, and figures for the sweep's MLflow run; the ladder table
    (every screened point, its compile where it had one) is written to ladder.csv."""
    screened = pd.read_csv(sweep_dir / SCREEN_CSV)
    metric = space.objective.primary.metric
    frame = frame.copy()
    ok = frame[Column.STATUS] == TrialStatus.OK if Column.STATUS in frame else pd.Series(dtype=bool)
    if metric in frame:
        ascending = space.objective.primary.mode == "min"
        frame.loc[ok, "verify_rank"] = frame.loc[ok, metric].rank(ascending=ascending, method="min")
    knobs = sorted({c for c in [*screened.columns, *frame.columns] if c.startswith(KNOB_PREFIX)})
    by_key = {_key(row, knobs): int(str(i)) for i, row in screened.iterrows()}
    matched: list[int | None] = [by_key.get(_key(row, knobs)) for _, row in frame.iterrows()]
    for source, column in SCREEN_COLUMNS.items():
        cells: list[Any] = [screened.at[i, source] if i is not None else None for i in matched]
        frame[column] = cells
    names = {c: c if c.startswith("verify_") else f"verify_{c}"
             for c in ("trial_id", "mlflow_run_id", "status", "failure_class", metric, "verify_rank")
             if c in frame}  # fmt: skip
    compiled = frame.assign(screen_row=pd.Series(matched, index=frame.index, dtype=object))
    compiled = compiled.dropna(subset=["screen_row"])
    compiled = compiled.astype({"screen_row": int}).set_index("screen_row")[list(names)]
    table = screened.rename(columns=SCREEN_COLUMNS).join(compiled.rename(columns=names))
    table.to_csv(sweep_dir / LADDER_CSV, index=False)
    notes, figures = _summary(frame, screened, space, metric)
    written = Space.model_validate(yaml.safe_load((sweep_dir / LADDER_SPACE).read_text()))
    start_notes, start_figures = _against_start(frame, written, metric)
    return frame, notes + start_notes, figures | start_figures


def _against_start(
    frame: pd.DataFrame, space: Space, metric: str
) -> tuple[list[str], dict[str, float]]:
    """The best compiled point against the space's warm start (the command it was imported
    from), on the verify rung's objective: a note and `ladder_best_over_start` (a ratio less
    1), or why there is none to compare."""
    starts = [dict(p) for p in space.search.warm_start]
    if not starts or frame.empty or "verify_rank" not in frame or metric not in frame:
        return [], {}
    knobs = knob_columns(frame.columns)
    is_start = frame.apply(
        lambda row: any(_within(s, {n: row[c] for c, n in knobs.items()}) for s in starts), axis=1
    )
    start = frame[is_start]
    if start.empty:
        return [], {}
    first, best = start.iloc[0], frame.sort_values("verify_rank").iloc[0]
    if first[Column.STATUS] != TrialStatus.OK:
        why = first.get(Column.FAILURE_CLASS)
        why = first[Column.STATUS] if missing(why) else why
        return [f"ladder: the warm start (trial {first['trial_id']}) did not compile: {why}"], {}
    if float(best[metric]) == float(first[metric]):
        return [f"ladder: the warm start (trial {first['trial_id']}) is the best compiled point"
                f" ({metric} {first[metric]:,.0f})"], {"ladder_best_over_start": 0.0}  # fmt: skip
    gain = float(best[metric]) / float(first[metric]) - 1
    return [
        f"ladder: the best compiled point (trial {best['trial_id']}) against the warm start "
        f"(trial {first['trial_id']}, the command the space starts from): {metric} "
        f"{best[metric]:,.0f} against {first[metric]:,.0f}, {gain:+.1%}"
    ], {"ladder_best_over_start": gain}


def _summary(
    frame: pd.DataFrame, screened: pd.DataFrame, space: Space, metric: str
) -> tuple[list[str], dict[str, float]]:
    compiled = (
        frame[frame["screen_compiled_for"].notna()] if "screen_compiled_for" in frame else frame
    )
    fits = int((screened["verdict"] == FITS).sum())
    figures = {"ladder_screened": float(len(screened)), "ladder_screen_fits": float(fits),
               "ladder_compiled": float(len(frame))}  # fmt: skip
    explored = len(frame) - len(compiled)
    notes = [
        f"ladder: screened {counted(len(screened), 'point')} by the estimate ({fits:,} fit), "
        f"compiled {len(frame):,} for {space.target}"
        + (f" ({explored} drawn by TPE over what the screen cannot tell apart)" if explored else "")
        + " (see ladder.csv)"
    ]
    ok = (
        compiled[compiled[Column.STATUS] == TrialStatus.OK]
        if Column.STATUS in compiled
        else compiled.iloc[:0]
    )
    twin = "screen_est_tokens_per_sec_per_chip"
    if len(ok) >= 3 and metric in ok and ok[twin].notna().sum() >= 3:
        pair = ok[[twin, metric]].astype(float).dropna()
        if pair[twin].nunique() > 1 and pair[metric].nunique() > 1:
            rho = float(pair[metric].corr(pair[twin], method="spearman"))
            figures["ladder_rank_correlation_screen_verify"] = rho
            notes.append(
                f"ladder: rank correlation (Spearman) of the screen's est. tokens/s and the "
                f"compile's over {len(pair)} compiled points: {rho:+.2f}"
            )
        else:
            notes.append(
                "ladder: no rank correlation: one of the rungs gave every compiled point the "
                "same figure"
            )
    said_fits = compiled["screen_verdict"] == FITS
    oom = (
        compiled[Column.FAILURE_CLASS].isin(["oom_hbm", "oom_vmem"])
        if Column.FAILURE_CLASS in compiled
        else said_fits & False
    )
    wrong_fit, wrong_over = (
        int((said_fits & oom).sum()),
        int((~said_fits & (compiled[Column.STATUS] == TrialStatus.OK)).sum()),
    )
    figures["ladder_screen_fit_but_oom"] = float(wrong_fit)
    figures["ladder_screen_over_but_fit"] = float(wrong_over)
    if wrong_fit or wrong_over:
        notes.append(
            f"ladder: the compile overturned the screen's memory verdict on {wrong_fit + wrong_over} "
            f"point(s): {wrong_fit} the screen said fit ran out of memory, {wrong_over} it said "
            "were over fit"
        )
    return notes, figures


def run_rung(sweep_dir: Path, frame: pd.DataFrame, space: Space) -> tuple[Path | None, list[str]]:
    """The run rung: the `run` best compiled points as a run-fidelity space for the target's
    slices (run_rung.yaml), and a note saying how to run it."""
    ladder = space.search.ladder
    if ladder is None or ladder.run == 0 or "verify_rank" not in frame:
        return None, []
    best = frame[frame["verify_rank"].notna()].sort_values("verify_rank").head(ladder.run)
    if best.empty:
        return None, ["ladder: no compiled point fits: the run rung has nothing to run"]
    written = Space.model_validate(yaml.safe_load((sweep_dir / LADDER_SPACE).read_text()))
    search = written.search.model_copy(update={"ladder": None})
    try:  # the engine's own turn to run fidelity: an estimated objective becomes its measured twin
        rung = with_fidelity(written.model_copy(update={"search": search}), "run")
    except SpaceError as exc:
        return None, [f"ladder: the run rung is not written: {exc}"]
    data = rung.model_dump(mode="json", exclude_defaults=True)
    data["name"] = f"{written.name}-run"
    kept = {k: v for k, v in data.get("search", {}).items() if k != "startup_trials"}
    data["search"] = {**kept, "sampler": "random", "trials": len(best),
                      "warm_start": [typed_point(written, row) for _, row in best.iterrows()]}  # fmt: skip
    Space.model_validate(data)  # what is written loads
    path = sweep_dir / RUN_RUNG
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path, [
        f"ladder: the run rung's {len(best)} best compiled point(s) wait for {space.target} "
        f"slices: `{sweeper_command('run', str(path))}` on a Ray cluster that has them"
    ]
