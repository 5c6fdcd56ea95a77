"""The progress line's best is the sweep's best by the rule the final table uses: a point
measured again is shown beside its first figure and never becomes the best."""

from __future__ import annotations

from ray.tune.experiment import Trial

from sweeper.answer.progress import ProgressCallback
from sweeper.answer.table import best_row
from sweeper.space.load import load_space
from sweeper.space.points import REMEASURE_KEY
from trainer.trial.events import Fidelity, TrialStatus
from trainer.trial.result import TrialResult

METRIC = "tokens_per_sec_per_chip"


def _ended(trial_id: str, value: float, again: str = "") -> Trial:
    trial = Trial("sweeper", config={REMEASURE_KEY: again} if again else {}, trial_id=trial_id,
                  stub=True)  # fmt: skip
    result = TrialResult(status=TrialStatus.OK, figures={METRIC: value}, hardware="cpu",
                         fidelity=Fidelity.RUN)  # fmt: skip
    trial.run_metadata.last_result = result.to_report([METRIC])
    return trial


def test_a_point_measured_again_never_becomes_the_progress_lines_best(capsys):
    space = load_space("smoke", {"search.trials": 2, "search.remeasure": 1})
    progress = ProgressCallback(space, "20261205-000000-abcd", "results/smoke/x")
    progress.setup()
    ended = [_ended("a1", 100.0), _ended("b2", 120.0), _ended("r3", 150.0, again="b2")]
    for trial in ended:
        progress.on_trial_start(0, ended, trial)
        progress.on_trial_complete(0, ended, trial)
    err = capsys.readouterr().err
    lines = err.splitlines()
    said = " ".join(err.split())  # a line folds to the terminal's width
    assert lines[0].startswith("sweep 20261205-000000-abcd:")  # the id first: resume needs it
    assert "sweeper resume 20261205-000000-abcd" in said.split("[1/3")[0]
    assert "again b2: 150.0 (first 120.0; it ranks by their mean, 135.0) by r3" in said
    last = [line for line in lines if line.startswith("[")][-1]  # the last event's first line
    assert last.startswith("[3/3 done, 0 running, 0 failed, best 135.0]"), last
    # The final table's rule, over the same rows, names the same best.
    import pandas as pd

    frame = pd.DataFrame([
        {"trial_id": "a1", "status": "ok", METRIC: 100.0, "remeasure_of": ""},
        {"trial_id": "b2", "status": "ok", METRIC: 120.0, "remeasure_of": ""},
        {"trial_id": "r3", "status": "ok", METRIC: 150.0, "remeasure_of": "b2"},
    ])  # fmt: skip
    best = best_row(frame, space.objective.primary)
    assert best is not None and best.trial_id == "b2"
    assert f"best {best.ranking_figure(METRIC):,.1f}]" in last


def test_the_banner_says_trials_and_re_measurements_apart_and_resumes_from_here(
    capsys, tmp_path, monkeypatch
):
    """`run smoke --trials 3` announced 5 trials (2 were the best points measured again,
    unsaid), and its `sweeper resume ID` lacked the `--results-dir` the sweep was run with."""
    monkeypatch.chdir(tmp_path)
    space = load_space("smoke", {"search.trials": 3, "search.remeasure": 2})
    elsewhere = tmp_path / "sweeps"
    ProgressCallback(space, "20261205-000000-abcd", str(elsewhere / "smoke" / "x")).setup()
    banner = " ".join(capsys.readouterr().err.split())  # the banner alone, unfolded
    assert "3 trials of smoke, then the best 2 measured again (5 runs in all)" in banner
    assert "resume 20261205-000000-abcd --results-dir sweeps`" in banner, banner
    one = load_space("smoke", {"search.trials": 1, "search.remeasure": 0})
    ProgressCallback(one, "20261205-000000-abcd", str(tmp_path / "results" / "smoke" / "x")).setup()
    banner = " ".join(capsys.readouterr().err.split())
    assert "1 trial of smoke, best" in banner and "--results-dir" not in banner, banner


def test_a_sweep_run_without_ray_says_its_id_and_how_to_resume_first(capsys, tmp_path):
    """Without Ray the host runner never called the callbacks' setup: the sweep's id and its
    resume command were never printed."""
    from types import SimpleNamespace

    from sweeper.sweep.host import HostRunner

    space = load_space("smoke", {"search.trials": 2, "search.remeasure": 0})
    sweep_dir = tmp_path / "results" / "smoke" / "20261205-000000-abcd"
    sweep_dir.mkdir(parents=True)
    nothing_more = SimpleNamespace(suggest=lambda trial_id: None)  # the search has ended
    sweep = SimpleNamespace(searcher=nothing_more, space=space, sweep_dir=sweep_dir,
                            experiment_path=str(tmp_path / "experiment"), remeasure=0)  # fmt: skip
    progress = ProgressCallback(space, "20261205-000000-abcd", str(sweep_dir))
    HostRunner(sweep, runtime=None, callbacks=[progress], recorded={}).fit()
    err = capsys.readouterr().err
    assert err.startswith("sweep 20261205-000000-abcd: 2 trials of smoke"), err
    assert "resume 20261205-000000-abcd" in err


def test_a_trial_tuning_its_kernels_says_how_many_compiles_of_how_many(capsys):
    """A compile trial with `kernels.tune: compile` compiles candidates for minutes: its line
    says how far along the tuner is, not only `compiling`."""
    from trainer.trial.result import running_report

    space = load_space("smoke", {"search.trials": 1})
    progress = ProgressCallback(space)
    trial = _ended("t1", 1.0)
    progress.on_trial_start(0, [trial], trial)
    report = running_report([METRIC], "tuning kernels", tuned=3, tunes=8)
    progress.on_trial_result(0, [trial], trial, report)
    assert "t1 tuning kernels: compile 3 of 8" in " ".join(capsys.readouterr().err.split())
