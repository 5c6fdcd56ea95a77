"""The report's knob importances: only knobs whose value differed between the trials that ran."""

from __future__ import annotations

import optuna

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
