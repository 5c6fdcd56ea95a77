"""The calibration's honesty rules (benchmarks/calibration.py): held-out rows are split by
whether their per-device program differs from a fit row's, and a prediction is frozen with
the commit that made it before its row is compared, never replaced, never from uncommitted
model code. On the compile records kept in results/calibration/."""

import json
import subprocess

import pytest

import benchmarks.calibration as calibration


@pytest.fixture(scope="module")
def rows():
    return calibration.estimate_rows(recompile=False, recorded=True)


def test_held_out_rows_are_split_by_whether_their_program_is_a_fit_rows(rows):
    """The 70B recipes on 256 chips run the 64-chip fit rows' per-device program (same
    FLOPs, collective bytes and kernel FLOPs): they are not evidence about other programs."""
    splits = {name: calibration.split(name, rows) for name in rows}
    assert {splits[n] for n in calibration.FIT} == {"fit"}
    assert splits["llama3.1-70b 8k bf16 256 chips"] == "held out, same program"
    assert splits["llama3.1-70b 8k fp8 256 chips"] == "held out, same program"
    for name in ("llama3.1-70b 8k fp8 re-tuned 64 chips", "llama3.1-405b 8k bf16 256 chips",
                 "qwen3-235b-a22b 4k bf16 256 chips"):  # fmt: skip
        assert splits[name] == "held out, distinct", name


def _repo(tmp_path, monkeypatch):
    """A git repository standing in for ours: `trainer/` committed clean."""
    (tmp_path / "trainer").mkdir()
    (tmp_path / "trainer" / "model.py").write_text("MXU = 0.72\n")
    for command in (["init", "-q"], ["add", "."], ["-c", "user.name=t", "-c", "user.email=t@t",
                                                    "commit", "-q", "-m", "model"]):  # fmt: skip
        subprocess.run(["git", *command], cwd=tmp_path, check=True)
    monkeypatch.setattr(calibration, "REPO", tmp_path)
    monkeypatch.setattr(calibration, "FROZEN", tmp_path / "frozen.json")
    return tmp_path


def test_a_frozen_prediction_names_its_commit_and_is_never_replaced(tmp_path, monkeypatch):
    repo = _repo(tmp_path, monkeypatch)
    name = "llama3.1-70b 8k bf16 256 chips"
    calibration.freeze(name)
    made_by = calibration.compiled_by(name)
    key = calibration.frozen_key(name, made_by["libtpu"])
    pinned = json.loads((repo / "frozen.json").read_text())[key]
    assert pinned["compiler"] == made_by
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True,
                          text=True, check=True).stdout.strip()  # fmt: skip
    assert pinned["commit"] == head
    rows = calibration.estimate_rows(recompile=False, only=name, recorded=True)
    table = calibration.predict(rows[name], calibration.fit(rows))  # what the table shows
    assert pinned["tokens_per_sec_per_chip"] == pytest.approx(table, abs=0.01)
    with pytest.raises(SystemExit, match="never replaced"):
        calibration.freeze(name)


def test_no_prediction_is_frozen_from_uncommitted_model_code(tmp_path, monkeypatch):
    repo = _repo(tmp_path, monkeypatch)
    (repo / "trainer" / "model.py").write_text("MXU = 0.80\n")
    with pytest.raises(SystemExit, match="commit the model first"):
        calibration.freeze("llama3.1-70b 8k bf16 256 chips")
    assert not (repo / "frozen.json").exists()


def test_maxtexts_own_programs_of_the_moe_recipes_are_a_split_of_their_own(rows):
    """The published qwen3 rows ran MaxText's program; the held-out rows compile ours. Read on
    MaxText's own program (kept from MaxText 0.2.5's train_compile, its libtpu named in the
    record: the same as ours since 2026-12-04, so the two rows of a recipe differ in the
    program only), each row is reported apart."""
    theirs = [name for name in rows if name in calibration.MAXTEXT]
    assert len(theirs) == 2
    for name in theirs:
        ours = name.removesuffix(" on MaxText")
        assert calibration.split(name, rows) == "held out, MaxText's program"
        assert calibration.compiled_by(name)["libtpu"] == calibration.compiled_by(ours)["libtpu"]


@pytest.mark.xfail(
    strict=True,
    reason="the step model has no cost for the MoE routing libtpu 0.0.52 offloads to the "
    "SparseCores (gather_offload/scatter_offload async custom calls, priced as HBM bytes at "
    "the HBM rate beside the TensorCore): MaxText's qwen3 programs read +32% (bf16) and "
    "+45% (fp8), ours +7% and +13%. Within 15%/10% before 2026-12-04 only because those "
    "calls were misread: the TensorCore was charged their bytes and waited for every engine",
)
def test_both_programs_of_each_moe_recipe_read_near_the_published_figure(rows):
    """Both programs of each qwen3 recipe read within 15% of the published figure, ours
    within 10% (with the grouped matmuls uncounted, MaxText's read +36%)."""
    from trainer.spec.mxu import FP8_MXU_EFFICIENCY, MXU_EFFICIENCY

    constants = (MXU_EFFICIENCY, FP8_MXU_EFFICIENCY)
    for name in (n for n in rows if n in calibration.MAXTEXT):
        ours = name.removesuffix(" on MaxText")
        assert abs(calibration.error(rows[name], constants)) < 0.15, name
        assert abs(calibration.error(rows[ours], constants)) < 0.10, ours
