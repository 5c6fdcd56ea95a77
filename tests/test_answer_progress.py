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
    assert lines[0].startswith("sweep 20261205-000000-abcd:")  # the id first: resume needs it
    assert "sweeper resume 20261205-000000-abcd" in lines[0]
    assert "again b2: 150.0 (first 120.0; it ranks by their mean, 135.0) by r3" in err
    assert lines[-1].startswith("[3/3 done, 0 running, 0 failed, best 135.0]"), lines[-1]
    # The final table's rule, over the same rows, names the same best.
    import pandas as pd

    frame = pd.DataFrame([
        {"trial_id": "a1", "status": "ok", METRIC: 100.0, "remeasure_of": ""},
        {"trial_id": "b2", "status": "ok", METRIC: 120.0, "remeasure_of": ""},
        {"trial_id": "r3", "status": "ok", METRIC: 150.0, "remeasure_of": "b2"},
    ])  # fmt: skip
    best = best_row(frame, space.objective.primary)
    assert best is not None and best.trial_id == "b2"
    assert f"best {best.ranking_figure(METRIC):,.1f}]" in lines[-1]
