"""Splash blocks tuned per kernel at compile fidelity (`kernels.tune: compile`, issue 51):
each kernel compiled alone for TPU7x with candidate blocks under the trial's scoped VMEM
limit, the compiler's refusals dropped, the rest priced by the step model; the trial's
program runs the choice, and a second trial with the same kernels reads it back."""

from __future__ import annotations

import json

import pytest

from tests.compile_helpers import _compile
from trainer.compile.tiles import TILES_DIR, candidates

pytestmark = pytest.mark.tpu_compile

MODEL = {"preset": "tiny-dense", "d_model": 256, "num_layers": 1, "num_heads": 8,
         "num_kv_heads": 8, "head_dim": 128}  # fmt: skip
# 512-row blocks at 2k under a 16 MiB scoped VMEM limit, where 2048-row blocks overflow.
TRIAL = {
    "model": MODEL,
    "seq_len": 2048,
    "kernels": {"attention": "splash", "tune": "compile"},
    "xla": {"scoped_vmem_kib": 16384, "judge": False},
}


def _splash_blocks(events: dict) -> dict[str, tuple[int, ...]]:
    """The query and key blocks each Splash call of the compiled trial program carries."""
    calls = events["compiled"]["program_cost"]["kernel_calls"]
    out = {}
    for call in calls:
        if call["name"].startswith("splash_") and call["blocks"]:
            kernel = "forward" if "_fwd" in call["name"] else "backward"
            out[kernel] = (call["blocks"][0][-2], call["blocks"][1][-2])
    return out


def test_candidates_hold_the_trials_blocks_and_divide_the_sequence():
    listed = candidates(2048, (256, 256, 256))
    assert listed[0] == (256, 256, 256)
    assert set(listed[1:]) == {(q, kv, kv) for q in (512, 1024, 2048) for kv in (512, 1024, 2048)}


def test_the_tuner_chooses_blocks_that_fit_the_vmem_limit_and_the_program_runs_them(tmp_path):
    cache = {"enabled": False, "cache_dir": str(tmp_path / "cache")}
    code, events, err = _compile(tmp_path, {**TRIAL, "convergence": cache}, timeout=1200)
    assert code == 0, err[-3000:]
    effect = events["compiled"]["effects"]["kernels.tune"]
    (saved,) = (tmp_path / "cache" / TILES_DIR).glob("*.json")
    tuning = {k["kernel"]: k for k in json.loads(saved.read_text())["kernels"]}
    for tuned in tuning.values():
        refused = [t for t in tuned["tried"] if t["failure"]]
        priced = [t for t in tuned["tried"] if t["seconds"] is not None]
        assert refused and priced, tuned  # 2048-row blocks overflow 16 MiB; smaller compile
        assert all(2048 in t["blocks"] and "vmem" in t["failure"] for t in refused), refused
        assert len(refused) + len(priced) == len(candidates(2048, (512, 512, 512)))
        best = min(t["seconds"] for t in priced)
        assert next(t for t in priced if t["blocks"] == tuned["chosen"])["seconds"] == best
    # The forward's 512-row blocks cost more grid steps than larger ones that fit: changed.
    assert tuning["forward"]["chosen"] != tuning["forward"]["given"]
    # The trial's program carries the chosen blocks (it would carry 512 if the choice were
    # ignored), and the tuner said so: active, with what it tried.
    chosen = {k: tuple(t["chosen"][:2]) for k, t in tuning.items()}
    assert _splash_blocks(events) == chosen
    assert effect["status"] == "active" and "refused by the compiler" in effect["reason"]
    # Its priced choice makes the whole step no slower than the blocks it was given.
    given = {**TRIAL, "kernels": {"attention": "splash"}, "convergence": cache}
    (tmp_path / "given").mkdir()
    code, untuned, err = _compile(tmp_path / "given", given)
    assert code == 0, err[-3000:]
    assert events["summary"]["est_step_time_s"] <= untuned["summary"]["est_step_time_s"]
    # A second trial with the same kernels reads the tuning back instead of compiling it.
    (tmp_path / "again").mkdir()
    code, again, err = _compile(tmp_path / "again", {**TRIAL, "convergence": cache})
    assert code == 0, err[-3000:]
    assert "read from the cache" in again["compiled"]["effects"]["kernels.tune"]["reason"]
    assert _splash_blocks(again) == chosen


def test_at_run_fidelity_the_tuner_is_inert_and_says_why(tmp_path):
    from tests.helpers import run_trainer

    config = {**TRIAL, "steps": 2, "backend": "cpu", "num_devices": 1,
              "convergence": {"enabled": False}, "per_device_batch": 1}  # fmt: skip
    config.pop("xla")
    code, events, err = run_trainer(config, tmp_path, timeout=600)
    assert code == 0, err[-3000:]
    accepted = next(e for e in events if e["event"] == "accepted")
    assert accepted["effects"]["kernels.tune"]["status"] == "inert"
