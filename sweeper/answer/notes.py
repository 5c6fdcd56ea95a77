"""What a sweep's notes say about its table: whether the best trial is within the noise of the
next (and what measuring both again said), which trials shared their cores, which knobs the
trials reported as not acting fully on their backend, and, for MaxText, which knobs changed
its program."""

from __future__ import annotations

import json
from typing import Any

import pandas as pd

from sweeper.answer.table import INTERVAL, ok_rows, ranked
from sweeper.record.row import REMEASURED, Column, knob_columns, missing, ranking_of
from sweeper.space.points import counted
from sweeper.space.schema import Objective
from trainer.trial.events import EffectStatus, KnobEffect
from trainer.trial.timing import MIN_STEPS_FOR_INTERVAL

# A trial whose cores other processes used more than this share of the time measured them too.
CONTENDED = 0.10


def _interval(row: Any, metric: str, prefix: str = "") -> str:
    low, high = (f"{prefix}{c}" for c in INTERVAL.get(metric, ("", "")))
    if low not in row or missing(row[low]) or missing(row[high]):
        return ""
    return f" (95% interval {row[low]:,.0f}-{row[high]:,.0f})"


def _overlap(a: Any, b: Any, metric: str, prefix: str = "") -> bool | None:
    low, high = (f"{prefix}{c}" for c in INTERVAL.get(metric, ("", "")))
    cells = [r.get(c) for r in (a, b) for c in (low, high)] if low else []
    if not cells or any(missing(v) for v in cells):
        return None
    return bool(a[low] <= b[high] and b[low] <= a[high])


def noise_notes(frame: Any, metric: str, maximize: bool) -> list[str]:
    """What the run's noise says about the table: whether the best trial is within the noise of
    the next (their 95% intervals overlap), what measuring both again said, and which trials
    shared their cores."""
    notes: list[str] = []
    if frame.empty or Column.STATUS not in frame:
        return notes
    ok = ranked(frame, Objective(metric=metric, mode="max" if maximize else "min"))
    attempted = ok[ok[f"{REMEASURED}by"].notna()] if f"{REMEASURED}by" in ok else ok.iloc[:0]
    if len(attempted):  # measured again: the points are judged on both measurements
        notes += _remeasure_notes(ok, attempted, metric, maximize)
    elif len(ok) >= 2 and metric in INTERVAL and set(INTERVAL[metric]) <= set(ok.columns):
        best, second = ok.iloc[0], ok.iloc[1]
        overlap = _overlap(best, second, metric)
        if overlap is not None:
            verdict = "within the noise of" if overlap else "ahead of, beyond the noise of,"
            notes.append(
                f"noise: the best trial {best[Column.TRIAL_ID]} ({best[metric]:,.0f} {metric}"
                f"{_interval(best, metric)}) is {verdict} the next, {second[Column.TRIAL_ID]} "
                f"({second[metric]:,.0f}{_interval(second, metric)})"
                + ("; measure both again (more steps) before choosing" if overlap else "")
            )
    if metric in INTERVAL and "timed_steps" in ok and len(ok) >= 2:
        few = ok[ok["timed_steps"].fillna(0) < MIN_STEPS_FOR_INTERVAL]
        if len(few):
            notes.append(
                f"noise: {counted(len(few), 'trial')} timed fewer than {MIN_STEPS_FOR_INTERVAL} steps "
                f"(trial.steps less measure.skip_steps): no 95% interval, so the table cannot "
                "say whether the winner is within the noise; run more steps"
            )
    if "cpu_contention" in frame:
        busy = frame[frame["cpu_contention"].fillna(0) > CONTENDED]
        if len(busy):
            shares = ", ".join(f"{_named(r)} {r['cpu_contention']:.0%}" for _, r in busy.iterrows())
            notes.append(
                f"contention: other processes used the cores of {counted(len(busy), 'trial')} while they "
                f"were measured ({shares}): their figures measure those processes too"
            )
    return notes


UNPINNED = "unpinned"  # the `cores` of a CPU trial that could lease none (execute.trainable)


def pinning_notes(frame: pd.DataFrame) -> list[str]:
    """Trials that ran on every core because they could lease none: their figures measure the
    other trials' load too, and the table marks them."""
    if frame.empty or Column.CORES not in frame:
        return []
    unpinned = frame[frame[Column.CORES].astype(str) == UNPINNED]
    if unpinned.empty:
        return []
    names = ", ".join(_named(r) for _, r in unpinned.iterrows())
    return [
        f"unpinned: {counted(len(unpinned), 'trial')} leased no core within 60 s and ran on every core "
        f"({names}): their figures are not comparable to the pinned trials' (marked "
        "'unpinned' in the table)"
    ]


def _named(row: Any) -> str:
    """A trial as the table names it: a re-measurement by the point it measured again."""
    again = row.get(Column.REMEASURE_OF)
    trial = str(row[Column.TRIAL_ID])
    return f"{again} (measured again)" if isinstance(again, str) and again else trial


def _remeasure_notes(
    ok: pd.DataFrame, attempted: pd.DataFrame, metric: str, maximize: bool
) -> list[str]:
    """What measuring the best points again said: which has no second figure; whether the
    order of the first two measured again held, which leads by the mean of both (the rule
    every view ranks by) and whether beyond the noise; and, where a point measured once now
    ranks first, that its lead rests on one measurement."""
    again = f"{REMEASURED}{metric}"
    notes = [
        f"re-measured: {r[Column.TRIAL_ID]} has no second figure (its re-measurement failed): "
        "it ranks by its first"
        for _, r in attempted[attempted[again].isna()].iterrows()
    ]
    measured = attempted[attempted[again].notna()]
    best = ok.iloc[0]
    lead = measured.iloc[0] if len(measured) else None
    named = (
        "the best trial "
        if lead is not None and lead[Column.TRIAL_ID] == best[Column.TRIAL_ID]
        else ""
    )
    if len(measured) >= 2:
        notes.append(
            f"re-measured: {named}{_pair_note(measured.iloc[0], measured.iloc[1], metric, maximize)}"
        )
    elif lead is not None:
        notes.append(
            f"re-measured: {named}{lead[Column.TRIAL_ID]} ran {lead[metric]:,.0f}, then "
            f"{lead[again]:,.0f}{_interval(lead, metric, REMEASURED)} {metric}: it ranks by "
            f"their mean, {ranking_of(lead[metric], lead[again]):,.0f}"
        )
    if len(measured) and best[Column.TRIAL_ID] not in set(measured[Column.TRIAL_ID]):
        below = ", ".join(
            f"{r[Column.TRIAL_ID]} ({r[metric]:,.0f}, then {r[again]:,.0f})"
            for _, r in measured.iterrows()
        )
        notes.append(
            f"re-measured: the best trial {best[Column.TRIAL_ID]} ({best[metric]:,.0f}) was "
            f"measured once: the points measured again rank below it by the mean of their two "
            f"figures ({below}); its lead rests on one measurement"
        )
    return notes


def _pair_note(best: Any, second: Any, metric: str, maximize: bool) -> str:
    """Two points measured again (the note's words after `re-measured: `): whether their
    order held, which leads by the mean of both, and whether that lead is beyond the noise."""
    again = f"{REMEASURED}{metric}"

    def ahead(column: str) -> Any:
        first = (best[column] > second[column]) == maximize or best[column] == second[column]
        return best if first else second

    leader = {ahead(c)[Column.TRIAL_ID] for c in (metric, again)}
    means = [ranking_of(r[metric], r[again]) for r in (best, second)]
    overlap = _overlap(best, second, metric, REMEASURED)
    said = (
        "the order held"
        if leader == {best[Column.TRIAL_ID]}
        else f"the measurements disagree on the order (the first put "
        f"{ahead(metric)[Column.TRIAL_ID]} ahead, the second {ahead(again)[Column.TRIAL_ID]}); "
        f"by the mean of both, {best[Column.TRIAL_ID]} ranks first ({means[0]:,.0f} against "
        f"{means[1]:,.0f})"
    )
    if overlap is None:
        noise = ""
    elif overlap:
        noise = "; their second intervals overlap: within the noise, measure longer before choosing"
    elif len(leader) > 1:
        noise = (
            "; their second intervals do not overlap, yet the first measurements disagreed: "
            "the runs vary more than one run's interval says; measure longer before choosing"
        )
    else:
        noise = "; their second intervals do not overlap: the lead is beyond the noise"
    return (
        f"{best[Column.TRIAL_ID]} ran {best[metric]:,.0f}{_interval(best, metric)}, "
        f"then {best[again]:,.0f}{_interval(best, metric, REMEASURED)}; "
        f"{second[Column.TRIAL_ID]}, {second[metric]:,.0f}{_interval(second, metric)}, then "
        f"{second[again]:,.0f}{_interval(second, metric, REMEASURED)} {metric}: {said}{noise}"
    )


def effect_caveats(effects_per_trial: list[str | None]) -> list[str]:
    """What the trials themselves reported as not acting fully on their backend (the trainer's
    `effects`: inert, emulated, interpreted), one line per knob and status with a trial count."""
    seen: dict[tuple[str, str], tuple[str, int]] = {}
    for raw in effects_per_trial:
        if not raw or not isinstance(raw, str):
            continue
        for knob, said in json.loads(raw).items():
            effect = KnobEffect.model_validate(said)
            if effect.status == EffectStatus.ACTIVE:
                continue
            key = (knob, effect.status.value)
            reason, count = seen.get(key, (effect.reason, 0))
            seen[key] = (reason, count + 1)
    return [
        f"{knob} {status} in {count} trial{'s' if count > 1 else ''}: {reason}"
        for (knob, status), (reason, count) in sorted(seen.items())
    ]


def program_verdicts(frame: pd.DataFrame) -> list[str]:
    """Knobs of a MaxText sweep judged by the programs its compiled trials became (MaxText
    takes its settings as set and says nothing of their effect): two ok trials that differ in
    one knob only and compile to the same program show that knob inert between its two
    values there; different programs, active. One line per knob and pair of values."""
    needed = {Column.PROGRAM, Column.STATUS, Column.PROGRAM_FINGERPRINT}
    if not needed <= set(frame.columns) or not (frame[Column.PROGRAM] == "maxtext").any():
        return []
    ok = ok_rows(frame)
    ok = ok[ok[Column.PROGRAM_FINGERPRINT].notna()]
    columns = list(knob_columns(frame.columns))
    pairs: dict[tuple[str, str, str], dict[bool, list[str]]] = {}
    rows = [(r[Column.TRIAL_ID], {c: str(r[c]) for c in columns}, r[Column.PROGRAM_FINGERPRINT])
            for _, r in ok.iterrows()]  # fmt: skip
    for i, (first, point, program) in enumerate(rows):
        for second, other, other_program in rows[i + 1 :]:
            differ = [c for c in columns if point[c] != other[c]]
            if len(differ) != 1:
                continue
            (column,) = differ
            low, high = sorted((point[column], other[column]))
            seen = pairs.setdefault((column, low, high), {True: [], False: []})
            seen[program == other_program].append(f"{first}/{second}")
    notes = []
    for (column, low, high), seen in sorted(pairs.items()):
        knob = knob_columns([column])[column]
        if seen[False]:
            notes.append(f"{knob} {low} vs {high}: active (changes MaxText's program: trials "
                         f"{', '.join(seen[False])})")  # fmt: skip
        if seen[True]:
            notes.append(f"{knob} {low} vs {high}: inert (the same MaxText program: trials "
                         f"{', '.join(seen[True])})")  # fmt: skip
    return notes
