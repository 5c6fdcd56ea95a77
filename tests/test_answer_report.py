"""The report's knob importances: only knobs whose value differed between the trials that ran."""

from __future__ import annotations

import optuna
import pandas as pd

from sweeper.answer.report import importances_of


def _study(points: list[dict], sweep_id: str = "s1") -> optuna.Study:
    study = optuna.create_study(direction="maximize")
    dists = {
        "batch": optuna.distributions.CategoricalDistribution([1, 2, 3]),
        "remat": optuna.distributions.CategoricalDistribution(["full", "minimal"]),
        "tile": optuna.distributions.CategoricalDistribution([256, 512]),
    }
    for i, p in enumerate(points):
        study.add_trial(optuna.trial.create_trial(
            params=p, distributions={k: dists[k] for k in p}, value=float(i + 1),
            user_attrs={"sweep_id": sweep_id, "outcome": "ok"},
        ))  # fmt: skip
    return study


def test_a_knob_held_at_one_value_gets_no_importance():
    # Two trials, both at batch 2: the batch cannot explain their difference.
    study = _study([{"batch": 2, "remat": "full", "tile": 256},
                    {"batch": 2, "remat": "minimal", "tile": 256}])  # fmt: skip
    assert importances_of(study, "s1") == {"remat": 1.0}


def test_every_varied_knob_is_apportioned_and_nothing_when_nothing_varied():
    varied = _study([{"batch": b, "remat": r, "tile": 256} for b in (1, 2, 3)
                     for r in ("full", "minimal")])  # fmt: skip
    assert set(importances_of(varied, "s1")) == {"batch", "remat"}
    same = _study([{"batch": 2, "remat": "full", "tile": 256}] * 3)
    assert importances_of(same, "s1") == {}
    assert importances_of(varied, "another sweep") == {}


def test_importances_resting_on_one_trial_are_said_in_words_not_warned(tmp_path):
    """`sweeper report` of the v5e sweep printed Optuna's `UserWarning: Some regimes for
    parameter kernels.q_layout have less than 2 trials` on the terminal; the report now says
    which values ran once, under its importances (warnings are errors in these tests)."""
    import shutil

    from sweeper.answer.recover import sweep_frame
    from sweeper.answer.report import importance_words
    from sweeper.record.manifest import find_sweep
    from tests.helpers import REPO

    shutil.copytree(REPO / "results" / "v5e", tmp_path / "v5e")
    found = find_sweep("20261206-180103-144f", tmp_path / "v5e")
    assert found.manifest is not None
    study = optuna.load_study(study_name=found.manifest.study_name,
                              storage=found.manifest.optuna_storage)  # fmt: skip
    # The sweep as it was after its first 5 trials (seq_minor had run once), in memory.
    early = optuna.create_study(study_name=study.study_name, directions=study.directions)
    early.add_trials([t for t in study.trials if t.number < 5])
    frame = sweep_frame(found)[0]
    frame = frame[pd.to_numeric(frame["optuna_trial"], errors="coerce") < 5]  # not repeats
    importances = importances_of(early, found.sweep_id)
    assert "kernels.q_layout" in importances
    words = importance_words(frame, importances)
    assert "kernels.q_layout (seq_minor)" in words, words
    assert importance_words(frame, {}) == ""
