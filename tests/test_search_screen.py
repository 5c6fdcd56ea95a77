"""The ladder's first rung: every point of a space judged by the analytic estimate in this
process (sweeper/screen.py, `sweeper screen`)."""

from __future__ import annotations

import pandas as pd
from typer.testing import CliRunner

from sweeper.cli.app import app
from sweeper.search.screen import FITS, INVALID, OVER_HBM, screen, unseen_knobs
from sweeper.space.load import load_space
from sweeper.space.points import count_points
from sweeper.space.schema import Space


def _row(frame: pd.DataFrame, point: dict) -> pd.Series:
    match = pd.Series(True, index=frame.index)
    for key, value in point.items():
        match &= frame[f"knob:{key}"].astype(str) == str(value)
    (index,) = frame.index[match]
    return frame.loc[index]


def test_every_point_of_the_70b_space_gets_a_verdict_and_the_fitting_ones_a_rank():
    space = load_space("llama31_70b_8k_tpu7x")
    frame = screen(space)
    assert len(frame) == count_points(space) == 576
    assert set(frame["verdict"]) <= {FITS, OVER_HBM, INVALID}
    # The published recipe (trial 0) fits by the estimate, as it does when compiled.
    recipe = _row(frame, space.search.warm_start[0])
    assert recipe["verdict"] == FITS and 80 < recipe["est_hbm_per_device_gib"] < 94.75
    # Three sequences a device with float32 moments and every layer input on device: over.
    heavy = frame[
        (frame["knob:per_device_batch"] == 3)
        & (frame["knob:mu_dtype"] == "float32")
        & (frame["knob:remat.custom.decoder_layer_input"] == "device")
    ]
    assert len(heavy) and set(heavy["verdict"]) == {OVER_HBM}
    # Rank 1 is the fastest point that fits; over-HBM points have no rank.
    fits = frame[frame["verdict"] == FITS]
    assert (
        fits.loc[fits["rank"] == 1, "est_tokens_per_sec_per_chip"].iloc[0]
        == fits["est_tokens_per_sec_per_chip"].max()
    )
    assert frame.loc[frame["verdict"] != FITS, "rank"].isna().all()


def test_a_long_screen_says_how_far_it_has_come(monkeypatch):
    """An imported recipe's space holds a million points (about 25 minutes at 1.5 ms each):
    the screen reports every PROGRESS_EVERY points judged, and the end, for the CLI's bar."""
    from sweeper.search import screen as screening

    monkeypatch.setattr(screening, "PROGRESS_EVERY", 100)
    heard: list[tuple[int, int]] = []
    frame = screen(load_space("llama31_70b_8k_tpu7x"),
                   progress=lambda done, of: heard.append((done, of)))  # fmt: skip
    assert heard == [(i, 576) for i in range(0, 576, 100)] + [(576, 576)] and len(frame) == 576


def test_knobs_the_estimate_cannot_see_are_named():
    frame = screen(load_space("llama31_70b_8k_tpu7x"))
    # Splash layouts and the scoped VMEM limit change the compiled program, not the formulas.
    assert set(unseen_knobs(frame)) == {
        "kernels.q_layout",
        "kernels.k_layout",
        "xla.scoped_vmem_kib",
    }


def test_a_sample_names_unseen_only_knobs_it_compared():
    """A sample's points differ in several knobs at once: a knob no two of them compare is
    not called unseen (every knob was, precision included, before)."""
    space = load_space("llama31_70b_8k_tpu7x")
    full = set(unseen_knobs(screen(space)))
    sampled = unseen_knobs(screen(space, sample=6))
    assert set(sampled) <= full and "precision.mode" not in sampled


def test_a_sample_screens_that_many_points_and_the_cli_says_its_fidelity(tmp_path):
    space = load_space("llama31_70b_8k_tpu7x")
    assert len(screen(space, sample=50)) == 50
    out = tmp_path / "screen.csv"
    result = CliRunner().invoke(
        app, ["screen", "llama31_70b_8k_tpu7x", "--top", "3", "--out", str(out)]
    )
    assert result.exit_code == 0, result.output
    assert "fidelity estimate" in result.output and len(pd.read_csv(out)) == 576
    local = CliRunner().invoke(app, ["screen", "smoke"])
    assert local.exit_code == 2 and "TPU target" in local.output


def test_a_maxtext_space_screens_as_ours_and_says_what_its_figures_are_of():
    """A MaxText space screens (issue 48; it was refused): each point is estimated as the same
    shape and settings in the engine's model, its `maxtext.*` knobs named as unseen, and the
    screen says its figures are not MaxText's program. The shipped space is the published
    recipe imported (1.26 million points): cut here to four of its knobs, and one MaxText
    setting made a knob, as a user adds one."""
    shipped = load_space("llama31_70b_8k_maxtext")
    doc = shipped.model_dump(mode="json")
    kept = ("per_device_batch", "precision.mode", "precision.granularity", "kernels.q_layout")
    doc["knobs"] = {k: v for k, v in doc["knobs"].items() if k in kept}
    doc["knobs"]["maxtext.optimizer_memory_host_offload"] = {"values": [False, True]}
    maxtext = Space.model_validate(doc)
    ours = maxtext.model_dump(mode="json")
    ours.update(program="sweeper-trainer", maxtext=None)
    ours["knobs"] = {k: v for k, v in ours["knobs"].items() if not k.startswith("maxtext.")}
    ours["search"]["warm_start"] = []
    frame, same = screen(maxtext), screen(Space.model_validate(ours))
    assert "maxtext.optimizer_memory_host_offload" in unseen_knobs(frame)
    assert (frame["verdict"] != "invalid").all() and len(frame) == 2 * len(same) > 2
    knobs = [c for c in same.columns if c.startswith("knob:")]
    figures = ["verdict", "est_tokens_per_sec_per_chip", "est_hbm_per_device_gib"]
    both = frame.drop_duplicates(knobs).merge(same, on=knobs, suffixes=("", "_ours"))
    assert len(both) == len(same)
    for figure in figures:
        assert (both[figure] == both[f"{figure}_ours"]).all(), figure
    said = CliRunner().invoke(app, ["screen", "llama31_70b_8k_maxtext", "--sample", "200"],
                              env={"COLUMNS": "200"})  # fmt: skip
    assert said.exit_code == 0 and "not MaxText's program" in said.output, said.output


def test_a_screen_that_cannot_judge_says_why():
    """A space whose every point is invalid screens to a table of verdicts and their reasons,
    not a traceback."""
    invalid = CliRunner().invoke(
        app, ["screen", "dense_short_tpu7x", "--set", "trial.mesh.context=3"]
    )
    assert invalid.exit_code == 0, invalid.output
    assert "(288 invalid)" in invalid.output and "cannot fill" in invalid.output


def test_a_sample_of_a_space_of_millions_draws_from_all_of_it():
    """A sample is drawn from the whole space, not from its first million points: the
    published llama3.1-70b 8k fp8 recipe's space holds 1.89 million, its first knob the
    batch (2, 1, 4), and a sample of the first million held no point at batch 4."""
    from sweeper.space.command import load_text, read_command, space_of
    from sweeper.space.points import count_points

    path = (
        "tests/data/tpu_recipes/training/ironwood/llama3.1-70b/8k-fp8-tpu7x-4x4x4/xpk/run_recipe.sh"
    )
    space = load_space(space_of(read_command(load_text(path)[0]), "row", None))
    assert count_points(space) > 1_000_000
    frame = screen(space, sample=120)
    knobs = [c for c in frame.columns if c.startswith("knob:")]
    assert len(frame) == 120 and not frame.duplicated(knobs).any()
    assert set(frame["knob:per_device_batch"]) == {1, 2, 4}
