"""A sweep's end, from Tune's trials: the results table and its best trial, the notes, the
files of the sweep folder (summary.csv, best.yaml, report.html), the parent run closed, the
manifest's ending. Each file is written whole or not at all; a results folder that takes no
more writes is said once, by name (`ResultsUnwritable`), and `sweeper resume` finishes it."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import pandas as pd
import yaml

from sweeper.answer import table
from sweeper.answer.notes import effect_caveats, noise_notes, pinning_notes, program_verdicts
from sweeper.execute import tune_state
from sweeper.record.callback import TrackingCallback
from sweeper.record.manifest import BEST, SUMMARY, Ending, SweepManifest, now
from sweeper.record.row import REMEASURED, Column, TrialRow
from sweeper.record.tracker import Tracker
from sweeper.record.trial import SweepTrial
from sweeper.search import ladder
from sweeper.search.searcher import SweepSearch
from sweeper.space.points import counted
from sweeper.space.schema import Space
from sweeper.sweep.prepare import local_path
from sweeper.sweep.result import ResultsUnwritable, SweepResult
from trainer.trial.files import UNWRITABLE, write_text


class Sweep(Protocol):
    """What finishing reads of a sweep (`sweeper.sweep.lifecycle.Sweep` is one)."""

    manifest: SweepManifest
    tracker: Tracker
    tracking: TrackingCallback
    placement_notes: list[str]
    searcher: SweepSearch | None
    interrupted: bool

    @property
    def space(self) -> Space: ...

    @property
    def sweep_id(self) -> str: ...

    @property
    def sweep_dir(self) -> Path: ...

    @property
    def inert_notes(self) -> list[str]: ...

    @property
    def experiment_name(self) -> str: ...

    @property
    def experiment_path(self) -> str: ...

    def write_manifest(self, ending: Ending | None = None) -> None: ...

    def best_config(self, point: dict[str, Any]) -> dict[str, Any]: ...

    def write_report(self, frame: pd.DataFrame, notes: list[str]) -> Path: ...

    def close_leftovers(self) -> list[str]: ...


@dataclass
class Writes:
    """The sweep folder's files, each written whole or not: what could not be, and why."""

    unwritten: list[str] = field(default_factory=list)

    def keep(self, what: str, write: Callable[[], Any]) -> Any:
        try:
            return write()
        except OSError as exc:
            if exc.errno not in UNWRITABLE:
                raise
            self.unwritten.append(f"{what}: {exc.strerror}")
            return None


def finish(sweep: Sweep, trials: Iterable[SweepTrial] | None) -> SweepResult:
    """The sweep's end (see the module): raises ResultsUnwritable, once every record is
    closed, when the results folder took no more writes."""
    frame = results_frame(sweep, trials)
    frame, ladder_notes = ladder_rungs(sweep, frame)
    counts = count(frame)
    best = table.best_row(frame, sweep.space.objective.primary)
    writes = Writes()
    writes.keep(SUMMARY, lambda: write_text(sweep.sweep_dir / SUMMARY, frame.to_csv(index=False)))
    best_config = writes.keep(BEST, lambda: write_best(sweep, best)) if best else None
    notes = sweep_notes(sweep, frame, best, ladder_notes, counts)
    journaled = close_records(sweep, frame, best, counts, notes, writes)
    if writes.unwritten:  # no ending in sweep.json: `sweeper resume` finishes it once there is room
        raise ResultsUnwritable(sweep.sweep_id, sweep.sweep_dir, writes.unwritten)
    sweep.write_manifest(
        Ending(
            state="interrupted" if sweep.interrupted else "finished",
            ended_at=now(),
            counts=counts,
            best_trial=best.trial_id if best else "",
            best_value=best.ranking_figure(sweep.space.objective.primary.metric) if best else None,
            notes=notes,
        )
    )
    experiment = local_path(sweep.experiment_path)
    if experiment is not None and not journaled and not sweep.interrupted:
        # Ended well, every record written: Ray's staging copies are no longer needed (an
        # unfinished sweep keeps them: resume mends a cut storage copy from them).
        tune_state.clean_staging(sweep.experiment_name)
    return SweepResult(
        manifest=sweep.manifest,
        sweep_dir=sweep.sweep_dir,
        trials=frame,
        best=best,
        counts=counts,
        notes=notes,
        interrupted=sweep.interrupted,
        journaled=journaled,
        best_config=best_config,
    )


def results_frame(sweep: Sweep, trials: Iterable[SweepTrial] | None) -> pd.DataFrame:
    """One row per trial that started, re-measurements beside the points they repeat, trace
    folders where they outlive Ray's."""
    tracking = sweep.tracking
    rows = table.rows(
        trials if trials is not None else tracking.seen.values(),
        tracking.finals,
        tracking.run_id,
        tracking.attempts,
    )
    frame = table.remeasured(table.frame_of_rows(rows), sweep.space.objective.primary.metric)
    experiment = local_path(sweep.experiment_path)
    if experiment is not None and Column.PROFILE_DIR in frame:  # the copy that outlives Ray's
        frame[Column.PROFILE_DIR] = [
            tune_state.in_storage(str(p), experiment) if isinstance(p, str) and p else p
            for p in frame[Column.PROFILE_DIR]
        ]
    return frame


def ladder_rungs(sweep: Sweep, frame: pd.DataFrame) -> tuple[pd.DataFrame, list[str]]:
    """A ladder's verify rung joined to its screen (ranks, correlation: summary.csv, MLflow,
    ladder.csv) and its run rung written; a sweep without a ladder is left as it is."""
    if sweep.space.search.ladder is None or frame.empty:
        return frame, []
    if not (sweep.sweep_dir / ladder.SCREEN_CSV).exists():
        return frame, [f"ladder: {ladder.SCREEN_CSV} is missing: the rungs cannot be joined"]
    frame, notes, figures = ladder.verified(frame, sweep.sweep_dir, sweep.space)
    notes += ladder.run_rung(sweep.sweep_dir, frame, sweep.space)[1]
    sweep.tracker.log_ladder(frame, sweep.sweep_dir / ladder.LADDER_CSV, figures)
    return frame, notes


def count(frame: pd.DataFrame) -> dict[str, int]:
    """Trials by status: the search's own (re-measurements counted apart)."""
    search = table.searched(frame)
    counts = {"total": len(search)}
    if not search.empty:
        counts.update({str(k): int(v) for k, v in search[Column.STATUS].value_counts().items()})
    if len(search) < len(frame):
        counts["remeasured"] = len(frame) - len(search)
    return counts


def write_best(sweep: Sweep, best: TrialRow) -> dict[str, Any]:
    """best.yaml: the best trial's knobs, figure and configuration as it ran; that
    configuration, which `python -m trainer --config FILE` reruns."""
    metric = sweep.space.objective.primary.metric
    point = {name: value for name, value in best.knobs.items()}
    config = sweep.best_config(point)
    again = f"{REMEASURED}{metric}"
    measured_again = (  # its second figure, and the mean of both it ranked by
        {again: best.figure(again), "ranked_by_mean_of_both": best.ranking_figure(metric)}
        if best.figure(again) is not None
        else {}
    )
    write_text(
        sweep.sweep_dir / BEST,
        yaml.safe_dump(
            {
                "trial_id": best.trial_id,
                "knobs": point,
                metric: best.figure(metric),
                **measured_again,
                "fidelity": best.fidelity.value if best.fidelity else None,
                "hardware": best.hardware,
                "program_fingerprint": best.program_fingerprint,
                "trial": config,
            },
            sort_keys=False,
        ),
    )
    return config


def sweep_notes(
    sweep: Sweep,
    frame: pd.DataFrame,
    best: TrialRow | None,
    ladder_notes: list[str],
    counts: dict[str, int],
) -> list[str]:
    """What the table alone does not say: where trials ran, what was pinned, what acted only
    partly, the ladder, the noise, reuses, interruptions and where `best`'s trace is."""
    objective = sweep.space.objective.primary
    notes = [
        *sweep.placement_notes,
        *(f"pinned: {n}" for n in sweep.inert_notes),
        *effect_caveats(list(frame[Column.EFFECTS]) if Column.EFFECTS in frame else []),
        *program_verdicts(frame),
        *ladder_notes,
        *noise_notes(frame, objective.metric, objective.mode == "max"),
        *pinning_notes(frame),
    ]
    recipe = sweep.space.maxtext_program().recipe if sweep.space.program == "maxtext" else None
    if recipe is not None and recipe.unmodeled:
        maxtexts_count = (
            "maxtext_tflops_per_device" in frame
            and frame["maxtext_tflops_per_device"].notna().any()
        )
        whose = (
            "MFU and model FLOPs are MaxText's own count (maxtext_tflops_per_device), memory "
            "and step time its compiled program's; the screen's estimates"
            if maxtexts_count
            else "MFU, model FLOPs and the screen's estimates count the model's shape alone "
            "(memory and step time are MaxText's compiled program's); they"
        )
        notes.append(f"model: {whose} do not model: " + "; ".join(recipe.unmodeled))
    notes += profile_notes(frame, best.trial_id if best else "")
    if Column.REUSED_FROM in frame and frame[Column.REUSED_FROM].notna().any():
        reused = int(frame[Column.REUSED_FROM].notna().sum())
        notes.append(
            f"reused: {counted(reused, 'trial')} asked for a point this study had measured"
        )
    if sweep.interrupted:
        notes.append("interrupted: trials still running were killed and recorded as such")
    if sweep.searcher is not None and sweep.searcher.exhausted:
        notes.append(
            f"the space ran out of new points after {counted(counts['total'], 'trial')}: every point the "
            "sampler drew again had run in this sweep"
        )
    return notes


def profile_notes(frame: pd.DataFrame, best: str = "") -> list[str]:
    """Where the best point's profile is (its re-measurement traced its last steps), and
    when the re-measurements then made another point the `best`, that it was not traced."""
    if Column.REMEASURE_OF not in frame or Column.PROFILE_DIR not in frame:
        return []
    again = frame[(frame[Column.REMEASURE_OF].fillna("").astype(str) != "")
                  & (frame[Column.PROFILE_DIR].fillna("").astype(str) != "")]  # fmt: skip
    notes = [
        f"profile: the point of trial {row[Column.REMEASURE_OF]}"
        f"{' (the best)' if row[Column.REMEASURE_OF] == best else ''}, measured again by trial "
        f"{row[Column.TRIAL_ID]}, traced its last steps: {row[Column.PROFILE_DIR]} (and its "
        "MLflow run's profile/; xprof or TensorBoard read it)"
        for _, row in again.iterrows()
    ]
    if notes and best and best not in set(again[Column.REMEASURE_OF]):
        notes.append(
            f"profile: the best trial, {best}, was not traced (the re-measurements ranked it "
            "first after the trace above was taken): set `trial.profile` to trace its point"
        )
    return notes


def close_records(
    sweep: Sweep,
    frame: pd.DataFrame,
    best: TrialRow | None,
    counts: dict[str, int],
    notes: list[str],
    writes: Writes,
) -> int:
    """Runs left open closed, the journal replayed, the report written and logged, the
    parent run closed (KILLED when the sweep did not end well); `notes` gains what happened
    meanwhile. The records still waiting in the journal."""
    notes += sweep.close_leftovers()
    sweep.tracker.flush()  # a store back by now: the outage is in the notes it keeps
    notes += sweep.tracker.outages
    told = len(sweep.tracker.outages)
    report = writes.keep("report.html", lambda: sweep.write_report(frame, notes))
    if report is not None:
        writes.keep("the report's MLflow artifact", lambda: sweep.tracker.log_report(report))
    if writes.unwritten:
        notes.append(f"results folder full, not written: {'; '.join(writes.unwritten)}")
    # Every run is closed even when the folder is full: KILLED, as the sweep did not end well.
    status = "KILLED" if sweep.interrupted or writes.unwritten else "FINISHED"
    sweep.tracker.finish_sweep(best, counts, status=status, notes=notes)
    journaled = sweep.tracker.flush()
    notes += sweep.tracker.outages[told:]
    if journaled:
        notes.append(
            f"tracking store still unreachable: {journaled} records wait in "
            f"{sweep.tracker.journal.where}; resuming the sweep replays them once it answers"
        )
    return journaled
