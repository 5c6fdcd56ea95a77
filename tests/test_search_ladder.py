"""The ladder (search.ladder, sweeper/ladder.py): the screen picks what the verify rung compiles,
the compile's ranks are joined to the screen's, and the run rung is written from the best."""

from __future__ import annotations

import pandas as pd
import pytest
import yaml
from mlflow.tracking import MlflowClient

from sweeper.search.ladder import (
    BY_EDGE,
    BY_RANK,
    BY_START,
    LADDER_CSV,
    RUN_RUNG,
    SCREEN_CSV,
    choose,
    verify_rung,
)
from sweeper.search.screen import FITS, INVALID, OVER_HBM
from sweeper.space.errors import SpaceError
from sweeper.space.load import load_space
from sweeper.space.points import count_points
from sweeper.sweep.run import run_sweep

LADDER = {
    "name": "ladder",
    "target": "tpu7x:2x2x1",
    "model": {"preset": "tiny-dense"},
    "trial": {"seq_len": 256},
    "search": {"ladder": {"verify": 6, "run": 1}, "seed": 0, "concurrency": 2},
    "knobs": {
        "remat.policy": {"values": ["full", "minimal"]},
        "per_device_batch": {"values": [0.5, 1, 2, 4]},
        "precision.mode": {"values": ["bf16", "fp8"]},
    },
}


def _screened(rows: list[tuple[str, float, float]]) -> pd.DataFrame:
    frame = pd.DataFrame(
        [
            {
                "knob:x": i,
                "verdict": v,
                "est_tokens_per_sec_per_chip": t,
                "est_hbm_per_device_gib": m,
            }
            for i, (v, t, m) in enumerate(rows)
        ]
    )
    fits = frame["verdict"] == FITS
    frame.loc[fits, "rank"] = frame.loc[fits, "est_tokens_per_sec_per_chip"].rank(ascending=False)
    return frame


def test_the_verify_rung_takes_the_best_that_fit_and_the_fast_ones_near_the_memory_edge():
    space = load_space(
        {
            **LADDER,
            "search": {"ladder": {"verify": 2, "edge": 0.1}},
            "constraints": {"max_memory_per_device_gib": 10},
        }
    )
    frame = choose(
        _screened(
            [
                (FITS, 100, 5),  # best: rank 1
                (FITS, 90, 9.5),  # rank 2 (also near the edge)
                (FITS, 80, 9.8),  # near the edge, but slower than the verify set: not compiled
                (OVER_HBM, 120, 10.5),  # over by 5%, faster: compiled, it may fit
                (OVER_HBM, 130, 12),  # over by 20%: beyond the edge
                (INVALID, float("nan"), float("nan")),
            ]
        ),
        space,
    )
    assert list(frame["compiled_for"]) == [BY_RANK, BY_RANK, "", BY_EDGE, "", ""]


def test_the_memory_edge_defaults_to_the_estimates_measured_error_for_the_models_kind():
    """Unset, the edge is the estimate's memory error measured for the model's kind (EDGE):
    a mixture-of-experts space compiles a fast point the estimate puts 20% over its memory
    limit (the estimate reads MoE memory up to 32% high), a dense space does not; a space's
    own edge stands for either."""
    rows = [(FITS, 100, 5), (FITS, 90, 9), (OVER_HBM, 120, 12), (OVER_HBM, 130, 14)]
    budget = {"constraints": {"max_memory_per_device_gib": 10}}
    chosen = {}
    for name, model, ladder in (
        ("dense", "tiny-dense", {"verify": 2}),
        ("moe", "tiny-moe", {"verify": 2}),
        ("moe, edge set", "tiny-moe", {"verify": 2, "edge": 0.1}),
    ):
        space = load_space({**LADDER, **budget, "model": {"preset": model},
                            "search": {"ladder": ladder}})  # fmt: skip
        chosen[name] = list(choose(_screened(rows), space)["compiled_for"])
    assert chosen["dense"] == [BY_RANK, BY_RANK, "", ""]
    assert chosen["moe"] == [BY_RANK, BY_RANK, BY_EDGE, ""]  # +40%: beyond even the MoE edge
    assert chosen["moe, edge set"] == chosen["dense"]


def test_what_the_screen_cannot_tell_apart_the_verify_rung_explores_with_tpe():
    """The screen cannot tell scoped VMEM limits apart (no estimated figure changes): the
    verify rung compiles the screen's picks, then TPE trials over the VMEM values, the knobs
    the screen did judge held to the values of its picks."""
    from sweeper.search.ladder import verify_rung
    from sweeper.search.screen import unseen_knobs

    vmem = {"xla.scoped_vmem_kib": {"values": [32768, 65536]}}
    space = load_space({**LADDER, "search": {"ladder": {"verify": 3}, "seed": 0},
                        "knobs": {**LADDER["knobs"], **vmem}})  # fmt: skip
    verify, frame = verify_rung(space)
    assert unseen_knobs(frame) == ["xla.scoped_vmem_kib"]
    chosen = frame[frame["compiled_for"] != ""]
    # Three distinct estimated points: none two that differ only in the VMEM limit (each
    # screened point has a twin at the other limit, the same figures, the same rank).
    seen = ["knob:remat.policy", "knob:per_device_batch", "knob:precision.mode"]
    assert len(chosen) == 3 and not chosen[seen].astype(str).duplicated().any()
    assert verify.search.sampler == "tpe" and verify.search.trials == len(chosen) + 3
    assert verify.knobs["xla.scoped_vmem_kib"].values == [32768, 65536]
    for name in ("remat.policy", "per_device_batch", "precision.mode"):
        picked = {str(v) for v in chosen[f"knob:{name}"]}
        held = {str(v) for v in verify.knobs[name].values}
        assert held == picked or {float(v) for v in held} == {float(v) for v in picked}, name
    # Without such a knob, the rung compiles exactly the screen's picks.
    plain, picked = verify_rung(load_space({**LADDER, "search": {"ladder": {"verify": 3}}}))
    assert plain.search.sampler == "random"
    assert plain.search.trials == len(picked[picked["compiled_for"] != ""])


def test_the_verify_rung_compiles_the_spaces_warm_start_first():
    """An imported command is the space's warm start: the ladder compiles it before the
    screen's picks (what its best is measured against), once, even where the screen ranks it
    low; a warm start the screen picked too is compiled once, as the warm start."""
    slow = {"remat.policy": "full", "per_device_batch": 0.5, "precision.mode": "bf16"}
    space = load_space({**LADDER, "search": {**LADDER["search"], "warm_start": [slow]}})
    verify, frame = verify_rung(space)
    assert verify.search.warm_start[0] == slow
    picked = frame[frame["compiled_for"].isin([BY_RANK, BY_EDGE])]
    assert verify.search.trials == len(picked) + 1
    start = frame[frame["compiled_for"] == BY_START]
    assert len(start) == 1 and start.iloc[0]["knob:per_device_batch"] == 0.5
    assert slow not in verify.search.warm_start[1:]
    best = {k.removeprefix("knob:"): v for k, v in picked.sort_values("rank").iloc[0].items()
            if k.startswith("knob:")}  # fmt: skip
    best["per_device_batch"] = float(best["per_device_batch"])
    again, frame = verify_rung(load_space({**LADDER, "search": {**LADDER["search"],
                                                                "warm_start": [best]}}))  # fmt: skip
    assert (
        again.search.trials == verify.search.trials - 1
        and not (frame["compiled_for"] == BY_START).any()
    )


def test_a_ladder_needs_a_tpu_target_and_our_trainer():
    with pytest.raises(SpaceError, match=r"search\.ladder: the ladder screens and compiles"):
        load_space({**LADDER, "target": "local"})
    with pytest.raises(SpaceError, match="fidelity run contradicts it"):
        load_space({**LADDER, "fidelity": "run"})


@pytest.mark.tpu_compile
def test_a_ladder_screens_every_point_compiles_the_best_and_writes_the_run_rung(tmp_path):
    slow = {"remat.policy": "minimal", "per_device_batch": 1, "precision.mode": "fp8"}
    search = {**LADDER["search"], "ladder": {"verify": 4, "run": 1}, "warm_start": [slow]}
    space = load_space({**LADDER, "search": search})
    result = run_sweep(space, results_dir=tmp_path)
    screened = pd.read_csv(result.sweep_dir / SCREEN_CSV)
    assert len(screened) == count_points(space) == 16
    compiled = screened[screened["compiled_for"].notna()]
    # The verify rung compiled the warm start, then exactly the points the screen chose, best
    # first; the best is weighed against the warm start (the command the space came from).
    assert len(result.trials) == len(compiled) == 5
    frame = result.trials.sort_values("optuna_trial")
    assert frame.iloc[0]["screen_compiled_for"] == BY_START
    start_tokens = frame.iloc[0]["est_tokens_per_sec_per_chip"]
    frame = frame.iloc[1:]
    ranks = list(frame["screen_rank"])
    assert ranks[0] == 1 and ranks == sorted(ranks)  # in the screen's order
    assert set(frame["fidelity"]) == {"compile"} and set(frame["hardware"]) == {"TPU7x"}
    ok = frame[frame["status"] == "ok"]
    best = ok.sort_values("est_tokens_per_sec_per_chip", ascending=False).iloc[0]
    assert best["verify_rank"] == 1
    # summary.csv and ladder.csv carry both rungs; points never compiled have no verify figure.
    summary = pd.read_csv(result.sweep_dir / "summary.csv")
    assert {"screen_verdict", "screen_rank", "verify_rank"} <= set(summary.columns)
    table = pd.read_csv(result.sweep_dir / LADDER_CSV)
    assert len(table) == 16 and table["verify_status"].notna().sum() == len(frame) + 1
    assert table.loc[table["screen_compiled_for"].isna(), "verify_status"].isna().all()
    # MLflow: each trial's run carries its ranks, the sweep's run the rungs' figures.
    client = MlflowClient(result.tracking_uri)
    run = client.get_run(best["mlflow_run_id"])
    assert run.data.tags["ladder.verify_rank"] == "1.0"
    assert run.data.tags["ladder.screen_rank"] == str(best["screen_rank"])
    parent = client.get_run(result.parent_run_id)
    assert parent.data.metrics["ladder_screened"] == 16
    assert parent.data.metrics["ladder_compiled"] == len(frame) + 1
    gain = best["est_tokens_per_sec_per_chip"] / start_tokens - 1
    assert parent.data.metrics["ladder_best_over_start"] == pytest.approx(gain)
    assert any(f"{gain:+.1%}" in n and "against the warm start" in n for n in result.notes)
    assert BY_START in (result.sweep_dir / "report.html").read_text()  # marked in the table
    assert "ladder_rank_correlation_screen_verify" in parent.data.metrics
    assert LADDER_CSV in {a.path for a in client.list_artifacts(result.parent_run_id)}
    assert "The ladder: screen against compile" in (result.sweep_dir / "report.html").read_text()
    # The run rung: the best compiled point, as a run-fidelity space, and how to run it.
    rung = load_space(result.sweep_dir / RUN_RUNG)
    assert rung.fidelity == "run" and rung.search.ladder is None
    assert rung.objective.primary.metric == "tokens_per_sec_per_chip"
    knobs = {k.removeprefix("knob:"): best[k] for k in best.index if k.startswith("knob:")}
    assert rung.search.warm_start == [knobs]
    assert any("wait for tpu7x:2x2x1 slices" in n for n in result.notes)
    written = yaml.safe_load((result.sweep_dir / RUN_RUNG).read_text())
    assert written["trial"] == LADDER["trial"]  # the space as written, not the compile rung's


def test_the_replayed_ladder_compiles_a_near_edge_point_within_its_verify_rung():
    """benchmarks.search_efficiency replays the ladder as a sweep runs it: the `verify` best
    that fit, then a point near the memory edge that would rank among them, then the rest;
    `fits_first` (the order replayed before) puts every fitting point ahead of the edge."""
    from benchmarks.search_efficiency import ladder_order, space_path

    space = load_space(space_path("search_table_c"), {"search.ladder": {"verify": 8}})
    budget = space.constraints.max_memory_per_device_gib
    rows = [
        {"knob:per_device_batch": i, "verdict": FITS, "est_hbm_per_device_gib": 1.0,
         "est_tokens_per_sec_per_chip": 100.0 - i, "rank": float(i + 1)}
        for i in range(12)
    ]  # fmt: skip
    edge = {"knob:per_device_batch": 99, "verdict": OVER_HBM,
            "est_hbm_per_device_gib": budget * 1.05, "est_tokens_per_sec_per_chip": 500.0}  # fmt: skip
    far = {"knob:per_device_batch": 98, "verdict": OVER_HBM,
           "est_hbm_per_device_gib": budget * 2, "est_tokens_per_sec_per_chip": 900.0}  # fmt: skip
    frame = pd.DataFrame([*rows, edge, far])
    order = [p["per_device_batch"] for p in ladder_order(space, 0, frame)]
    assert order[:8] == list(range(8)) and order[8] == 99
    assert order[9:13] == [8, 9, 10, 11] and order[13] == 98  # the rest fits before the far
    first = [p["per_device_batch"] for p in ladder_order(space, 0, frame, fits_first=True)]
    assert first[:12] == list(range(12)) and first[12] == 99
