"""Run fidelity's noise figures: the median step's 95% interval, drift across timing windows,
CPU contention on the trial's cores, and what the sweep's table says with them."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import numpy as np
import pandas as pd
import pytest

from sweeper.answer.notes import noise_notes
from sweeper.answer.table import remeasured, searched
from trainer.run.metrics import Contention
from trainer.trial.timing import step_time_stats, throughput_interval


def test_the_interval_holds_the_median_and_narrows_with_more_steps():
    rng = np.random.default_rng(1)
    few = step_time_stats(list(1.0 + 0.2 * rng.random(8)))
    many = step_time_stats(list(1.0 + 0.2 * rng.random(200)))
    for stats in (few, many):
        assert stats["step_time_median_low_s"] <= stats["step_time_median_s"]
        assert stats["step_time_median_s"] <= stats["step_time_median_high_s"]
    width = {k: s["step_time_median_high_s"] - s["step_time_median_low_s"]
             for k, s in (("few", few), ("many", many))}  # fmt: skip
    assert width["many"] < width["few"] / 2


def test_windows_show_drift_that_a_steady_trial_does_not_have():
    steady = step_time_stats([1.0, 1.01, 0.99] * 4, windows=3)
    drifting = step_time_stats([1.0] * 4 + [2.0] * 4 + [1.5] * 4, windows=3)
    assert steady["timing_windows"] == drifting["timing_windows"] == 3
    assert steady["window_spread"] < 0.05 < 0.5 < drifting["window_spread"]


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs Linux CPU affinity")
def test_another_process_on_the_trials_core_is_measured_as_contention():
    core = min(os.sched_getaffinity(0))
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {core})
    try:
        spin = (
            f"import os, time\nos.sched_setaffinity(0, {{{core}}})\n"
            "end = time.time() + 1.5\nwhile time.time() < end: pass"
        )
        busy = subprocess.Popen([sys.executable, "-c", spin])
        time.sleep(0.2)
        watch = Contention()
        time.sleep(1.0)  # this process idles: the core's busy time is the other one's
        share = watch.share()
        busy.wait()
    finally:
        os.sched_setaffinity(0, before)
    assert share is not None and share > 0.5


def _frame(best: tuple[float, float, float], second: tuple[float, float, float]) -> pd.DataFrame:
    rows = [
        {
            "trial_id": t,
            "status": "ok",
            "tokens_per_sec_per_chip": v,
            "tokens_per_sec_per_chip_low": lo,
            "tokens_per_sec_per_chip_high": hi,
            "cpu_contention": c,
        }
        for t, (v, lo, hi), c in (("a", best, 0.3), ("b", second, 0.0))
    ]
    return pd.DataFrame(rows)


def test_the_table_says_when_the_winner_is_within_the_noise_of_the_next():
    close = noise_notes(_frame((100, 90, 110), (95, 85, 104)), "tokens_per_sec_per_chip", True)
    assert "is within the noise of the next, b" in close[0] and "measure both again" in close[0]
    apart = noise_notes(_frame((100, 98, 102), (80, 78, 82)), "tokens_per_sec_per_chip", True)
    assert "beyond the noise of" in apart[0]
    assert any(n.startswith("contention: ") and "a 30%" in n for n in close)


def _measured_again(first: pd.DataFrame, a: tuple, b: tuple) -> pd.DataFrame:
    """`first` with its two points measured again (figure, low, high), as re-measuring rows."""
    again = _frame(a, b).assign(trial_id=["a2", "b2"], remeasure_of=["a", "b"])
    table = pd.concat([first.assign(remeasure_of=""), again], ignore_index=True)
    return remeasured(table, "tokens_per_sec_per_chip")


def test_measuring_the_best_two_again_says_whether_the_lead_held():
    metric = "tokens_per_sec_per_chip"
    first = _frame((100, 98, 102), (80, 78, 82))  # apart, the first time
    held = _measured_again(first, (99, 97, 101), (82, 80, 84))
    assert list(searched(held)["trial_id"]) == ["a", "b"]  # re-measurements do not rank
    assert held.set_index("trial_id").loc["a", f"remeasured_{metric}"] == 99
    note = next(n for n in noise_notes(held, metric, True) if n.startswith("re-measured"))
    assert note.startswith("re-measured: the best trial a ran 100 (95% interval 98-102), then 99")
    assert "the order held" in note and "beyond the noise" in note
    flipped = _measured_again(first, (81, 79, 83), (90, 88, 92))
    note = next(n for n in noise_notes(flipped, metric, True) if n.startswith("re-measured"))
    assert "disagree on the order (the first put a ahead, the second b)" in note
    assert "by the mean of both, a ranks first (90 against 85)" in note  # 90.5 and 85
    assert "yet the first measurements disagreed" in note and "beyond the noise" not in note
    close = _measured_again(first, (90, 85, 95), (88, 84, 93))
    note = next(n for n in noise_notes(close, metric, True) if n.startswith("re-measured"))
    assert "the order held" in note and "within the noise" in note
    # A re-measuring trial is named by the point it measured again, never by its own id.
    busy = next(n for n in noise_notes(close, metric, True) if n.startswith("contention"))
    assert "a (measured again) 30%" in busy and "a2" not in busy


def test_a_point_measured_again_ranks_by_the_mean_of_both_in_every_view():
    """Measured again, the two best points rank by the mean of their two figures (the first
    leans high: it was picked for being among the best). Here the second measurements put b
    ahead beyond their intervals and the means agree (a 95, b 102.5): b is the best trial of
    the table, the notes, best_row (best.yaml, export, MLflow, the manifest) and the terminal
    table, which shows each figure and (`mean`) the mean it ranks by."""
    from rich.console import Console

    from sweeper.answer.console import sweep_table
    from sweeper.answer.table import best_row, ranked
    from sweeper.record.manifest import SweepManifest
    from sweeper.space.load import load_space
    from sweeper.space.schema import Objective

    metric = "tokens_per_sec_per_chip"
    first = _frame((100, 96, 104), (95, 91, 99)).assign(cpu_contention=0.0)
    frame = _measured_again(first, (90, 88, 92), (110, 108, 112))
    objective = Objective(metric=metric, mode="max")
    assert list(ranked(frame, objective)["trial_id"]) == ["b", "a"]
    best = best_row(frame, objective)
    assert best is not None and best.trial_id == "b"
    assert best.figure(metric) == 95 and best.ranking_figure(metric) == 102.5
    notes = noise_notes(frame, metric, True)
    again = next(n for n in notes if n.startswith("re-measured"))
    assert again.startswith("re-measured: the best trial b ran 95 (95% interval 91-99), then 110")
    assert (
        "the first put a ahead, the second b" in again and "b ranks first (102 against 95)" in again
    )
    assert not any(n.startswith("noise: the best trial") for n in notes)  # judged on both
    space = load_space("smoke")
    manifest = SweepManifest(sweep_id="20261206-000000-abcd", space=space, study_name="s",
                             own_study=True, optuna_storage="", tracking_uri="",
                             experiment_id="", parent_run_id="", storage="")  # fmt: skip
    out = Console(width=200, record=True)
    out.print(sweep_table(manifest, frame.assign(mfu=0.1)))
    lines = out.export_text().splitlines()
    heads = lines[1].split()
    assert heads[2:5] == ["tokens/s/chip", "again", "mean"], lines[1]
    rows = [line.split() for line in lines if line.startswith(("a ", "b "))]
    assert [r[0] for r in rows] == ["b", "a"]
    assert rows[0][2:5] == ["95.0", "110.0", "102.5"] and rows[1][2:5] == ["100.0", "90.0", "95.0"]
    # Too narrow for a knob's words beside the figures: each trial's knobs whole, below them.
    knobs = frame.assign(mfu=0.1, **{"knob:remat.policy": ["save_dot_except_mlp", "full"] * 2,
                                     "knob:per_device_batch": [1, 2, 1, 2]})  # fmt: skip
    narrow = Console(width=80, record=True)
    narrow.print(sweep_table(manifest, knobs, width=80))
    text = narrow.export_text()
    assert (
        "knobs that varied:\nb  remat=full batch=2\na  remat=save_dot_except_mlp batch=1\n" in text
    )
    assert max(map(len, text.splitlines())) <= 80


def test_points_measured_again_below_one_measured_once_say_so():
    """The means of the points measured again (a 92.5, b 87.5) fall below a third point's one
    figure (c 93): c ranks first, and the notes say its lead rests on one measurement, beside
    what the two repeats said."""
    from sweeper.answer.table import best_row
    from sweeper.space.schema import Objective

    metric = "tokens_per_sec_per_chip"
    first = pd.concat([_frame((100, 98, 102), (95, 93, 97)),
                       _frame((93, 91, 95), (10, 9, 11)).iloc[:1].assign(trial_id="c")])  # fmt: skip
    frame = _measured_again(first.reset_index(drop=True), (85, 83, 87), (80, 78, 82))
    best = best_row(frame, Objective(metric=metric, mode="max"))
    assert best is not None and best.trial_id == "c" and best.ranking_figure(metric) == 93
    notes = [n for n in noise_notes(frame, metric, True) if n.startswith("re-measured")]
    assert notes[0].startswith("re-measured: a ran 100") and "the order held" in notes[0]
    assert notes[1].startswith("re-measured: the best trial c (93) was measured once")
    assert (
        "a (100, then 85), b (95, then 80)" in notes[1] and "rests on one measurement" in notes[1]
    )


def test_repeats_that_all_failed_leave_the_first_figures_and_say_so():
    """Both re-measurements failed: each point ranks by its first figure, the notes name the
    failed repeats and say nothing of points measured again ranking below the best."""
    metric, nan = "tokens_per_sec_per_chip", float("nan")
    first = _frame((100, 98, 102), (95, 93, 97))
    failed = _frame((nan, nan, nan), (nan, nan, nan)).assign(
        trial_id=["a2", "b2"], remeasure_of=["a", "b"], status="failed"
    )
    frame = remeasured(
        pd.concat([first.assign(remeasure_of=""), failed], ignore_index=True), metric
    )
    notes = [n for n in noise_notes(frame, metric, True) if n.startswith("re-measured")]
    assert notes == [
        "re-measured: a has no second figure (its re-measurement failed): it ranks by its first",
        "re-measured: b has no second figure (its re-measurement failed): it ranks by its first",
    ]


def test_too_few_timed_steps_give_no_interval_and_the_table_says_so():
    """One or two timed steps have no noise figure (one step's interval would be the step
    itself and call any lead beyond the noise): left out, and a note saying why."""
    two = step_time_stats([1.0, 1.2])
    assert "step_time_median_low_s" not in two and "step_time_median_high_s" not in two
    assert throughput_interval(two, 100.0) == {}
    three = step_time_stats([1.0, 1.2, 1.1])
    interval = throughput_interval(three, 100.0)
    assert interval["tokens_per_sec_per_chip_low"] < 100 < interval["tokens_per_sec_per_chip_high"]
    frame = _frame((100, float("nan"), float("nan")), (90, float("nan"), float("nan")))
    notes = noise_notes(frame.assign(timed_steps=[1, 1]), "tokens_per_sec_per_chip", True)
    assert any("2 trials timed fewer than 3 steps" in n for n in notes)
    assert not any("beyond the noise" in n for n in notes)


def test_re_measures_continue_across_a_restored_searcher(tmp_path):
    """A driver that dies while the best points are measured again: the restored searcher
    hands a cut-off re-measure the same point when Tune asks again for that trial, and the
    next one the next best point, never a point measured again already, then FINISHED."""
    import optuna
    from ray.tune.search import Searcher

    from sweeper.search.distributions import make_sampler
    from sweeper.search.searcher import SweepSearch
    from sweeper.space.load import load_space
    from sweeper.space.points import REMEASURE_KEY
    from trainer.trial.events import TrialStatus
    from trainer.trial.result import TrialResult

    space = load_space("smoke", {"search.trials": 3, "search.remeasure": 2})
    metric = space.objective.primary.metric

    def searcher() -> SweepSearch:
        return SweepSearch(space, sweep_id="s", metric=metric, mode="max",
                           sampler=make_sampler(space), study_name="s",
                           storage=f"sqlite:///{tmp_path}/optuna.db", remeasure=2)  # fmt: skip

    first = searcher()
    for n in range(3):
        assert REMEASURE_KEY not in first.suggest(f"t{n}")
    for n, value in enumerate((100.0, 300.0, 200.0)):
        assert first.suggest("r0") is None  # re-measures wait for every search trial
        done = TrialResult(status=TrialStatus.OK, figures={metric: value})
        first.on_trial_complete(f"t{n}", done.to_report([metric]))
    assert first.suggest("r0")[REMEASURE_KEY] == "t1"  # the best, t1, measured again
    first.save(str(tmp_path / "searcher.pkl"))  # Tune's checkpoint; then the driver dies
    restored = searcher()
    restored.restore(str(tmp_path / "searcher.pkl"))
    assert restored.suggest("r0")[REMEASURE_KEY] == "t1"  # r0 rerun: the same point
    assert restored.suggest("r1")[REMEASURE_KEY] == "t2"  # then the next best
    assert restored.suggest("r2") == Searcher.FINISHED
    study = optuna.load_study(study_name="s", storage=f"sqlite:///{tmp_path}/optuna.db")
    assert len(study.trials) == 3  # re-measures are no Optuna trials, nor repeated draws
