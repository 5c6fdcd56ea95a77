"""What the CLI says is said in words: no Python reprs (`['full', 'minimal']`,
`{'precision.mode': 'fp8'}`, `{'fits': 464, 'over_hbm': 112}`), counts that are honest
(`best of 1 ok` where 1 of 3 trials ended well, not `best 3 of 3`), thousands separated, and
one of a thing in the singular."""

from __future__ import annotations

import shutil

import pandas as pd
from typer.testing import CliRunner

from sweeper.cli.app import app
from sweeper.space.load import builtin_spaces
from tests.helpers import REPO, unfolded

REPR = ("{'", "['", "<space>")


def _validate(*args: str) -> str:
    result = CliRunner().invoke(app, ["validate", *args], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    return result.output


def test_validate_says_values_and_conditions_as_a_space_file_writes_them():
    out = _validate("v5e_dense")
    assert "[bf16, fp8, int8]" in out and "precision.mode is fp8 or int8" in out, out
    assert "kernels.attention is splash" in out
    assert not [r for r in REPR if r in out], out
    assert "ok: 36 points;" in out
    many = _validate("smoke", "--set", "knobs.per_device_batch={low: 1, high: 400}")
    assert "ok: 2,400 points; 4 trials with tpe, then the best 2 points measured again" in many
    one = _validate("smoke", "--set", "knobs.mesh.tensor.values=[1]", "--set",
                    "knobs.remat.policy.values=[full]", "--set", "search.trials=1",
                    "--set", "search.remeasure=1")  # fmt: skip
    assert "ok: 1 point; 1 trial with tpe, then the best 1 point measured again" in one, one


def test_a_warm_start_off_its_knobs_condition_is_refused_in_words():
    point = "search.warm_start=[{precision.mode: bf16, precision.granularity: per_axis}]"
    result = CliRunner().invoke(app, ["validate", "v5e_dense", "--set", point])
    assert result.exit_code == 2
    said = unfolded(result.output)
    assert "precision.granularity is only sampled when precision.mode is fp8 or int8" in said, said
    assert not [r for r in REPR if r in said], said


def test_help_of_every_command_of_a_space_names_every_builtin_space():
    for command in ("run", "validate", "screen", "tiles"):
        result = CliRunner().invoke(app, [command, "--help"], env={"COLUMNS": "400"})
        missing = [name for name in builtin_spaces() if name not in result.output]
        assert result.exit_code == 0 and not missing, (command, missing)


def test_the_table_counts_the_trials_that_ended_well(tmp_path):
    """`best 3 of 3` over a sweep where 1 of its 3 trials succeeded."""
    from sweeper.answer.console import sweep_table
    from sweeper.answer.recover import sweep_frame
    from sweeper.record.manifest import find_sweep

    shutil.copytree(REPO / "results" / "v5e", tmp_path / "v5e")
    found = find_sweep("20261206-180103-144f", tmp_path / "v5e")
    assert found.manifest is not None
    frame = sweep_frame(found)[0]
    # its first 5: 4 ok, 1 out of memory (its repeats of the best have no Optuna number)
    first = frame[pd.to_numeric(frame["optuna_trial"], errors="coerce") < 5]
    assert sweep_table(found.manifest, first).title == "best of 4 ok (5 trials)"
    assert sweep_table(found.manifest, first, rows=2).title == (
        "best of 4 ok (5 trials; the first 2 shown)"
    )
    failed = frame.assign(status="failed")
    assert sweep_table(found.manifest, failed.head(1)).title == "none ok (1 trial)"


def test_screen_verdicts_and_a_finished_sweep_are_counted_in_words(tmp_path):
    from sweeper.record.manifest import Ending, SweepManifest
    from sweeper.search.screen import verdict_counts
    from sweeper.sweep.result import SweepFinished

    verdicts = pd.DataFrame({"verdict": ["fits"] * 1464 + ["over_hbm"] * 112 + ["invalid"]})
    assert verdict_counts(verdicts) == "1,464 fit, 112 over HBM, 1 invalid"
    manifest = SweepManifest.read(REPO / "results/v5e/v5e_dense/20261206-180103-144f/sweep.json")
    ended = manifest.model_copy(update={"ending": Ending(
        state="finished", counts={"total": 5, "ok": 4, "killed": 1}, best_trial="567abc32")})  # fmt: skip
    message = str(SweepFinished(tmp_path / "v5e_dense" / manifest.sweep_id, ended))
    assert "(5 total, 4 ok, 1 killed; best trial 567abc32)" in message, message
