"""The engine end to end: real Ray Tune, Optuna, MLflow and trainer child processes."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pandas as pd
import pytest
import ray
import yaml
from mlflow.tracking import MlflowClient
from optuna.trial import TrialState
from ray import tune

from sweeper.answer.table import ranking_figure
from sweeper.execute.tune_state import staging_copies
from sweeper.record.stores import store_for
from sweeper.space.load import load_space
from sweeper.sweep.lifecycle import Sweep
from sweeper.sweep.run import run_sweep
from tests.helpers import MlflowServer, free_port

STEPS = 6


@pytest.fixture(scope="module", autouse=True)
def ray_local():
    ray.init(
        address="local",
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        logging_level="ERROR",
    )
    yield
    ray.shutdown()


def _children(client: MlflowClient, result):
    return client.search_runs(
        [result.experiment_id], filter_string=f"tags.mlflow.parentRunId = '{result.parent_run_id}'"
    )


def test_smoke_sweep_records_parent_children_steps_and_verdicts(tmp_path):
    result = run_sweep("smoke", results_dir=tmp_path, trials=3, set={"trial.steps": STEPS})
    # Three trials of the search, then its best two points measured again (run fidelity's default).
    assert result.counts == {"total": 3, "ok": 3, "remeasured": 2}
    client = MlflowClient(result.tracking_uri)
    parent = client.get_run(result.parent_run_id)
    assert parent.data.tags["sweeper.kind"] == "sweep" and parent.info.status == "FINISHED"
    assert parent.data.metrics["trials_ok"] == 3 and parent.data.metrics["trials_remeasured"] == 2
    # One run per point: a point measured again is recorded on its trial's run (issue 49).
    children = _children(client, result)
    again = [r for r in children if "remeasured_by" in r.data.tags]
    assert len(children) == 3 and len(again) == 2
    # Three trials are three distinct points: a point drawn again is not run (or counted) again.
    points = {tuple(sorted((k, v) for k, v in r.data.params.items() if k.startswith("knob.")))
              for r in children}  # fmt: skip
    assert len(points) == 3
    for run in children:
        assert run.info.status == "FINISHED"
        assert run.data.params["knob.remat.policy"] in ("full", "minimal", "save_qkv_proj")
        assert run.data.params["trial.model.preset"] == "tiny-dense"  # the fixed settings
        assert "mesh.tensor" not in run.data.metrics and "knob.mesh.tensor" not in run.data.metrics
        policy = run.data.params["knob.remat.policy"]
        assert run.info.run_name.startswith(run.data.tags["sweeper.trial_id"] + " ")
        assert f"remat={policy}" in run.info.run_name  # named for what it tried (short)
        assert run.data.metrics["tokens_per_sec_per_chip"] > 0
        assert run.data.tags["fidelity"] == "run" and run.data.tags["backend"] == "cpu"
        assert run.data.tags["convergence"] == "passed"
        history = client.get_metric_history(run.info.run_id, "loss")
        assert sorted(m.step for m in history) == list(range(STEPS))
        artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
        assert {"trial.json", "knob_effects.json"} <= artifacts
    # Outputs on disk, and the best is the fastest feasible trial of the search.
    table = result.trials
    frame = table[table["remeasure_of"].fillna("") == ""]
    assert (result.sweep_dir / "summary.csv").exists()
    best = yaml.safe_load((result.sweep_dir / "best.yaml").read_text())
    # The best: the fastest, each point measured again ranked by the mean of both figures.
    ranks = ranking_figure(frame, "tokens_per_sec_per_chip")
    assert best["trial_id"] == frame.loc[ranks.idxmax(), "trial_id"] == result.best.trial_id
    # (a point measured once ranks by its figure: it may lead where both repeats fell back)
    ranked_by = best.get("ranked_by_mean_of_both", best["tokens_per_sec_per_chip"])
    assert ranked_by == pytest.approx(ranks.max())
    # The two best points ran again, each as a Tune trial of its own (not told to Optuna, no
    # run of its own): its figure on the first trial's run and row, and who measured it.
    top = frame.sort_values("tokens_per_sec_per_chip", ascending=False)["trial_id"][:2]
    assert sorted(r.data.tags["sweeper.trial_id"] for r in again) == sorted(top)
    rows = table.set_index("trial_id")
    for run in again:
        first = rows.loc[run.data.tags["sweeper.trial_id"]]
        by = run.data.tags["remeasured_by"]
        assert first["remeasured_by"] == by and rows.loc[by, "remeasure_of"] == first.name
        assert run.data.tags["remeasured"] == "ok"
        assert (
            first["remeasured_tokens_per_sec_per_chip"]
            == pytest.approx(run.data.metrics["remeasured_tokens_per_sec_per_chip"])
            == pytest.approx(rows.loc[by, "tokens_per_sec_per_chip"])
        )
        assert run.data.metrics["tokens_per_sec_per_chip"] == pytest.approx(
            first["tokens_per_sec_per_chip"]
        )  # the first figure stays the run's own
    winner = result.best.trial_id
    # the note names the best: measured again, or once where both repeats fell back behind it
    said = (f"re-measured: the best trial {winner} ran ", f"re-measured: the best trial {winner} (")
    assert any(n.startswith(said) for n in result.notes), result.notes
    # The best point's re-measurement (the first, of the point best before the repeats)
    # traced its last two steps: the trace in its folder, on that trial's MLflow run, and in
    # the notes; the second point's was not traced. Had the repeats made the second the
    # best, a note says the best was not traced.
    traced = rows[rows["profile_dir"].fillna("") != ""]
    assert list(traced["remeasure_of"]) == [top.iloc[0]], traced
    assert list(Path(traced["profile_dir"].iloc[0]).rglob("*.xplane.pb"))
    traced_run = next(r for r in again if r.data.tags["sweeper.trial_id"] == top.iloc[0])
    assert client.list_artifacts(traced_run.info.run_id, "profile")
    said = [n for n in result.notes if n.startswith("profile: ")]
    best_mark = " (the best)" if winner == top.iloc[0] else ""
    assert said[0].startswith(f"profile: the point of trial {top.iloc[0]}{best_mark},")
    assert (winner == top.iloc[0]) == (len(said) == 1), said
    # Each measurement carries its noise: the median step's 95% interval, the drift across
    # timing windows, and how much of its cores other processes used; the table says whether
    # the winner is within the noise of the next.
    assert (frame["tokens_per_sec_per_chip_low"] <= frame["tokens_per_sec_per_chip"]).all()
    assert (frame["tokens_per_sec_per_chip"] <= frame["tokens_per_sec_per_chip_high"]).all()
    assert set(frame["timing_windows"]) == {3} and frame["cpu_contention"].between(0, 1).all()
    # (measured again, judged on both measurements, each with its interval)
    said = next(n for n in result.notes if n.startswith("re-measured: "))
    assert said.count("(95% interval") >= 3, said  # the traced repeat times 2 steps fewer
    # Each CPU trial reserved one of this 2-CPU Ray's CPUs and its trainer was pinned to one
    # core; trials that ran at the same time held different cores.
    assert frame["reused_from"].isna().all()
    assert set(frame["cores"]) <= {"0", "1"} and set(frame["processes"]) == {1}
    spans = list(zip(table["started_at"], table["ended_at"], table["cores"], strict=True))
    for i, (start, end, cores) in enumerate(spans):
        for other_start, other_end, other in spans[i + 1 :]:
            assert not (start < other_end and other_start < end and cores == other)
    study = result.study()
    ran = study.trials  # each point once: a draw of a point the sweep had never reaches it
    assert [t.state for t in ran] == [TrialState.COMPLETE] * 3
    assert all(max(t.constraints.values()) <= 0 for t in ran)
    assert study.metric_names == ["tokens_per_sec_per_chip"]  # named for optuna-dashboard
    # What the MLflow UI opens on: the experiment as model training, described; the sweep's
    # shared view sorted by the objective, with its columns; the sweep run's description.
    experiment = client.get_experiment(result.experiment_id)
    assert experiment.tags["mlflow.experimentKind"] == "custom_model_development"
    assert "Tiny dense model" in experiment.tags["mlflow.note.content"]
    view = json.loads(experiment.tags[f"mlflow.sharedViewState.sweep-{result.sweep_id}"])
    # Sorted by the figure each trial ranks by (a point measured again: the mean of both).
    assert view["orderByKey"] == "metrics.`ranking_tokens_per_sec_per_chip`"
    assert not view["orderByAsc"]
    ranking = {r.data.tags["sweeper.trial_id"]: r.data.metrics["ranking_tokens_per_sec_per_chip"]
               for r in children}  # fmt: skip
    assert ranking == pytest.approx(dict(zip(frame["trial_id"], ranks, strict=True)))
    assert max(ranking, key=ranking.__getitem__) == best["trial_id"]
    assert view["selectedColumns"][0] == "metrics.`tokens_per_sec_per_chip`"
    assert "params.`knob.remat.policy`" in view["selectedColumns"]
    assert view["runsExpanded"] == {result.parent_run_id: True}
    best_id = best["trial_id"]
    assert f"Best: trial {best_id}" in parent.data.tags["mlflow.note.content"]
    assert "report.html" in {a.path for a in client.list_artifacts(result.parent_run_id)}


# Every warm-start point names every knob (a missing one would be sampled).
CLEAN = {
    "limits.device_memory_gib": None,
    "fault.nan_at_step": None,
    "fault.crash_in_compile": False,
}
FAULTS = {
    "name": "faults",
    "target": "local",
    "devices": 8,
    "fidelity": "run",
    "model": {"preset": "tiny-dense"},
    "trial": {"seq_len": 64, "steps": STEPS, "backend": "cpu"},
    "constraints": {"convergence": False},
    "search": {
        "sampler": "random",
        "trials": 5,
        "remeasure": 0,
        "concurrency": 2,
        "warm_start": [
            {**CLEAN, "mesh.tensor": 1},
            {**CLEAN, "mesh.tensor": 8},
            {**CLEAN, "mesh.tensor": 1, "limits.device_memory_gib": 1e-4},
            {**CLEAN, "mesh.tensor": 1, "fault.nan_at_step": 2},
            {**CLEAN, "mesh.tensor": 1, "fault.crash_in_compile": True},
        ],
    },
    "knobs": {
        "mesh.fsdp": {"values": [-1]},
        "mesh.tensor": {"values": [1, 8]},  # tensor=8 cannot shard 2 kv heads
        "limits.device_memory_gib": {"values": [None, 1e-4]},
        "fault.nan_at_step": {"values": [None, 2]},
        "fault.crash_in_compile": {"values": [False, True]},
    },
}


def test_failures_are_classified_recorded_and_taught_to_optuna(tmp_path):
    result = run_sweep(load_space(FAULTS), results_dir=tmp_path)
    frame = result.trials.set_index("optuna_trial")
    assert len(frame) == 5  # the sweep finished every trial
    assert list(frame.loc[[0, 1, 2, 3, 4], "failure_class"]) == [
        "",
        "invalid_config",
        "oom_hbm",
        "diverged",
        "compile_error",  # the process died of SIGSEGV while compiling: a compiler crash
    ]
    assert "SIGSEGV" in frame.loc[4, "failure_message"], frame.loc[4, "failure_message"]
    # The over-budget program's memory stays in the table beside the budget it broke.
    assert frame.loc[2, "budget_gib"] == pytest.approx(1e-4)
    assert frame.loc[2, "needed_gib"] > frame.loc[2, "budget_gib"]
    assert frame.loc[[0, 1, 3], "needed_gib"].isna().all()
    client = MlflowClient(result.tracking_uri)
    by_number = {int(r.data.tags["sweeper.optuna_trial"]): r for r in _children(client, result)}
    assert by_number[1].data.tags["failure_class"] == "invalid_config"
    assert (
        by_number[2].data.tags["failure_class"] == "oom_hbm"
        and by_number[2].info.status == "FAILED"
    )
    assert by_number[3].data.tags["failure_class"] == "diverged"
    tail = client.download_artifacts(
        by_number[1].info.run_id, "trainer_log_tail.txt", str(tmp_path)
    )
    with open(tail) as handle:
        assert "not divisible by mesh axes" in handle.read()

    trials = {t.number: t for t in result.study().trials}
    assert trials[0].state == TrialState.COMPLETE and max(trials[0].constraints.values()) <= 0
    for number, violated in ((1, "validity"), (2, "memory"), (3, "convergence")):
        assert trials[number].state == TrialState.COMPLETE  # infeasible points are data, not errors
        assert trials[number].constraints[violated] > 0, (number, trials[number].constraints)
        assert trials[number].user_attrs["outcome"] == "infeasible"
    assert trials[4].state == TrialState.FAIL  # a crashed compiler says nothing of the point


class CountingCallback(tune.Callback):
    def __init__(self):
        self.completed = []

    def on_trial_complete(self, iteration, trials, trial, **info):
        self.completed.append(trial.last_result["trial_status"])


def test_a_pipeline_drives_the_lifecycle_with_its_own_callback_and_store(tmp_path):
    """prepare -> tuner -> finish, as another pipeline uses it: its own Tune callback, records
    in memory; tuner() builds without side effects, finish() happens once."""
    uri = f"memory:{tmp_path.name}"
    store = store_for(uri)
    sweep = Sweep.prepare(
        "smoke",
        results_dir=tmp_path,
        tracking_uri=uri,
        trials=2,
        set={"trial.steps": 4, "search.remeasure": 0},
    )
    assert [r.name for r in store.runs.values()] == [f"sweep-{sweep.sweep_id}"]  # opened here
    counter = CountingCallback()
    sweep.tuner()  # built and dropped: it starts nothing and records nothing
    assert len(store.runs) == 1
    grid = sweep.tuner(callbacks=[counter]).fit()
    assert len(grid) == 2 and not grid.errors
    assert counter.completed == ["ok", "ok"]
    result = sweep.finish()
    assert result is sweep.finish()  # once: Tune's experiment end already finished it
    assert store.read(result.parent_run_id).status == "FINISHED"
    children = store.search(result.experiment_id, {"sweeper.kind": "trial"})
    assert sorted(children) == sorted(result.trials["mlflow_run_id"])
    for _, row in result.trials.iterrows():
        run = store.read(row["mlflow_run_id"])
        assert run.status == "FINISHED" and run.tags["status"] == "ok"
        assert run.metrics["tokens_per_sec_per_chip"] == pytest.approx(
            row["tokens_per_sec_per_chip"]
        )
        assert len(run.history["loss"]) >= 4  # every step
    assert json.loads((result.sweep_dir / "mlflow_runs.json").read_text())["runs"].keys() == {
        r.trial_id for r in grid._experiment_analysis.trials
    }


@pytest.fixture
def mlflow_server(tmp_path):
    server = MlflowServer(tmp_path / "server")
    yield server.start()
    server.stop()


def test_sweep_against_a_real_mlflow_server(tmp_path, mlflow_server):
    result = run_sweep(
        "smoke",
        results_dir=tmp_path,
        tracking_uri=mlflow_server,
        trials=2,
        set={"trial.steps": 4, "search.remeasure": 0},
    )
    client = MlflowClient(mlflow_server)
    runs = _children(client, result)
    assert len(runs) == 2 and all(r.data.metrics["tokens_per_sec_per_chip"] > 0 for r in runs)
    assert client.get_run(result.parent_run_id).data.tags["sweeper.sweep_id"] == result.sweep_id
    # Artifacts went to the server's own store, not to a path on the driver.
    assert client.get_run(runs[0].info.run_id).info.artifact_uri.startswith("mlflow-artifacts:")
    assert "trial.json" in {a.path for a in client.list_artifacts(runs[0].info.run_id)}


def test_unreachable_tracking_server_is_a_clear_exit_2(tmp_path):
    port = free_port()  # nothing listens here
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "sweeper.cli",
            "run",
            "smoke",
            "--results-dir",
            str(tmp_path),
            "--tracking-uri",
            f"http://127.0.0.1:{port}",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "cannot reach the MLflow tracking store" in proc.stderr.replace("\n", " ")


def test_trial_timeout_kills_the_trainer_and_fails_in_optuna(tmp_path, capsys, monkeypatch):
    import psutil

    import sweeper.answer.progress

    monkeypatch.setattr(sweeper.answer.progress, "HEARTBEAT_S", 2.0)
    # A trainer that hangs after its first step: nothing more reaches Tune until the timeout.
    from collections import Counter

    result = run_sweep(
        "smoke",
        results_dir=tmp_path,
        trials=1,
        progress=True,
        set={
            "search.remeasure": 0,
            "trial.fault": {"crash_at_step": 1, "crash_mode": "hang"},
            "search.trial_timeout_s": 15,
        },
    )
    # Meanwhile the terminal still hears of it, in the phase it last reported, every heartbeat.
    trial_id = result.trials.iloc[0]["trial_id"]
    # (Starting, compiling or hung after step 1, whichever the load of the host made it.)
    err = capsys.readouterr().err
    wheres = Counter(
        re.sub(r" \(\d+ s\)$", "", line.split(f"] {trial_id} ", 1)[1])
        for line in err.splitlines()
        if f"] {trial_id} " in line
    )
    assert max(wheres.values()) >= 3, err[-3000:]
    row = result.trials.iloc[0]
    assert (row["status"], row["failure_class"]) == ("failed", "timeout")
    (trial,) = result.study().trials
    assert trial.state == TrialState.FAIL  # says nothing certain about the point: not learned from
    leftovers = [
        p
        for p in psutil.process_iter(["cmdline"])
        if str(tmp_path) in " ".join(p.info["cmdline"] or [])
    ]
    assert leftovers == []


def test_two_objectives_make_a_multi_objective_study(tmp_path):
    # moe_short: its warm start (expert 4) runs first, and it has offload values to pin on CPU.
    result = run_sweep(
        "moe_short",
        results_dir=tmp_path,
        trials=2,
        sampler="nsga2",
        set={
            "search.remeasure": 0,
            "trial.steps": 4,
            "objective.secondary": {"metric": "hbm_per_device_gib", "mode": "min"},
        },
    )
    study = result.study()
    assert [d.name for d in study.directions] == ["MAXIMIZE", "MINIMIZE"]
    for t in study.trials:
        assert t.state == TrialState.COMPLETE and len(t.values) == 2 and t.values[1] > 0
    # What did not act fully on the CPU is said with the result, and kept in MLflow.
    assert any(n.startswith("pinned: remat.policy") for n in result.notes)
    emulated = [n for n in result.notes if n.startswith("mesh.expert emulated in")]
    assert emulated and "ragged all-to-all" in emulated[0]
    client = MlflowClient(result.tracking_uri)
    path = client.download_artifacts(result.parent_run_id, "notes.txt", str(tmp_path))
    assert Path(path).read_text().splitlines() == result.notes


AOT = {
    "name": "aot",
    "target": "tpu7x:2x2x1",
    "fidelity": "compile",
    "model": {"preset": "tiny-dense"},
    "trial": {"seq_len": 256},
    "search": {
        "sampler": "random",
        "trials": 3,
        "concurrency": 2,
        "warm_start": [
            {
                "remat.policy": "full",
                "xla.scoped_vmem_kib": 32768,
                "per_device_batch": 1,
                "xla.collective_mode": "sparsecore_offload",
            },
            {"remat.policy": "minimal", "xla.scoped_vmem_kib": 65536, "per_device_batch": 1},
            {"remat.policy": "full", "xla.scoped_vmem_kib": 32768, "per_device_batch": 0.5},
        ],
    },
    "knobs": {
        "remat.policy": {"values": ["full", "minimal"]},
        "xla.scoped_vmem_kib": {"values": [32768, 65536]},
        "per_device_batch": {"values": [0.5, 1]},
        "xla.collective_mode": {"values": ["default", "sparsecore_offload"]},
    },
}


@pytest.mark.tpu_compile
@pytest.mark.slow  # 2 min; a compile-fidelity sweep: the ladder's compile rung
def test_compile_fidelity_sweep_for_tpu7x(tmp_path):
    import ray
    from ray import tune

    space = load_space(AOT)
    assert space.objective.primary.metric == "est_tokens_per_sec_per_chip"  # nothing is measured
    sessions: set[Path] = set()

    class Session(tune.Callback):  # the Ray session folder the sweep's own Ray made
        def on_trial_start(self, iteration, trials, trial, **info):
            context = ray.get_runtime_context()
            sessions.add(Path(context.get_temp_dir()) / context.get_session_name())

    ray.shutdown()  # a Ray an earlier test in this worker left up would be found, and kept
    result = run_sweep(space, results_dir=tmp_path, callbacks=[Session()])
    # What the sweep left behind: libtpu's logs in each trial's folder, not in /tmp/tpu_logs;
    # the Ray session folder of a sweep that ended well, removed with its Ray.
    assert list((tmp_path / "ray").glob("*/trial_*/tpu_logs/*")), "libtpu's logs: in the trial"
    assert sessions and not any(s.exists() for s in sessions), sessions
    frame = result.trials.set_index("optuna_trial")
    assert list(frame.loc[[0, 1, 2], "status"]) == ["ok", "ok", "failed"]
    assert frame.loc[2, "failure_class"] == "invalid_config"  # global batch 4 over fsdp 8
    client = MlflowClient(result.tracking_uri)
    runs = {int(r.data.tags["sweeper.optuna_trial"]): r for r in _children(client, result)}
    for number in (0, 1):
        run = runs[number]
        assert run.data.tags["fidelity"] == "compile" and run.data.tags["hardware"] == "TPU7x"
        assert (
            run.data.metrics["est_tokens_per_sec_per_chip"] > 0
            and run.data.metrics["hbm_per_device_gib"] > 0
        )
        assert "tokens_per_sec_per_chip" not in run.data.metrics
    assert runs[0].data.params["knob.xla.scoped_vmem_kib"] == "32768"
    trials = {t.number: t for t in result.study().trials}
    assert trials[0].value == pytest.approx(frame.loc[0, "est_tokens_per_sec_per_chip"])
    assert trials[2].constraints["validity"] > 0
    # The SparseCore bundle compiles this small program to the same bytes: said, not hidden.
    # Trial 0 is the warm start; what the sampler draws after it varies, so count what was judged.
    effects = json.loads(frame.loc[0, "effects"])
    assert effects["xla.collective_mode"]["status"] == "inert", effects
    judged = [json.loads(e) for e in frame["effects"] if isinstance(e, str) and e]
    inert = sum(e.get("xla.collective_mode", {}).get("status") == "inert" for e in judged)
    plural = "s" if inert > 1 else ""
    note = f"xla.collective_mode inert in {inert} trial{plural}:"
    assert any(n.startswith(note) for n in result.notes), (note, result.notes)


def test_unknown_flag_in_a_space_stops_the_sweep_before_any_trial(tmp_path):
    from sweeper.space.errors import SpaceError

    bad = {**AOT, "knobs": {**AOT["knobs"], "xla.extra": {"values": [[], ["--xla_tpu_bogus=1"]]}}}
    bad["search"] = {**AOT["search"], "warm_start": []}
    with pytest.raises(SpaceError) as err:
        Sweep.prepare(load_space(bad), results_dir=tmp_path)
    assert err.value.field == "knobs.xla.extra" and "xla_tpu_bogus" in str(err.value)


def test_grid_sampler_runs_the_whole_grid_once(tmp_path):
    # 2 points, 3 trials asked: the grid caps the sweep, and its end does not crash it.
    result = run_sweep(
        "smoke",
        results_dir=tmp_path,
        sampler="grid",
        trials=3,
        set={
            "search.remeasure": 0,
            "trial.steps": 3,
            "constraints.convergence": False,
            "knobs.remat.policy.values": ["full"],
        },
    )
    assert result.counts == {"total": 2, "ok": 2}
    assert any("capped at 2" in note for note in result.notes), result.notes
    study = result.study()
    assert [t.state for t in study.trials] == [TrialState.COMPLETE] * 2
    assert sorted(t.params["mesh.tensor"] for t in study.trials) == [1, 2]


# SIGINT in `make test-slow`: the CLI turns SIGTERM into SIGINT, so the SIGTERM case (which
# also resumes) runs the same path.
@pytest.mark.parametrize(
    "sig",  # 2 min each; interrupt and resume: test_sweep_faults' Ctrl-C and killed-driver tests
    [pytest.param(s, marks=pytest.mark.slow) for s in (signal.SIGINT, signal.SIGTERM)],
)
def test_an_interrupted_sweep_leaves_every_record_terminal(tmp_path, sig):
    import optuna

    proc = subprocess.Popen(
        [sys.executable, "-m", "sweeper.cli", "run", "smoke", "--results-dir", str(tmp_path),
         "--trials", "1", "--concurrency", "1", "--set", "trial.steps=400",
         "--set", "search.remeasure=0"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    # Interrupt while the trial trains: 400 steps take about 16 s on this host's CPU
    # (jax 0.12), so a signal 4 s after the first "training" line cuts the trial off (and its
    # run again on resume is not 40 s of 1,000 steps).
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if "1 running" in line and " training (" in line:
            time.sleep(4)
            break
    proc.send_signal(sig)
    out, _ = proc.communicate(timeout=180)
    assert proc.returncode == 130, "".join(lines) + out
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    runs = client.search_runs([client.get_experiment_by_name("smoke").experiment_id])
    statuses = sorted(r.info.status for r in runs)
    assert "RUNNING" not in statuses and "KILLED" in statuses, statuses
    study = optuna.load_study(study_name=None, storage=f"sqlite:///{tmp_path}/optuna.db")
    assert all(t.state != TrialState.RUNNING for t in study.trials)
    assert any(t.user_attrs.get("outcome") == "killed" for t in study.trials)
    (summary,) = tmp_path.glob("smoke/*/summary.csv")
    assert "killed" in summary.read_text()
    if sig != signal.SIGTERM:
        return
    # Resume continues it: the cut-off trials run again, each into an Optuna trial of its
    # own (the FAIL told at the interrupt stays, the record of who was cut off).
    killed = {t.number for t in study.trials if t.user_attrs.get("outcome") == "killed"}
    sweep_id = summary.parent.name
    resumed = subprocess.run(
        [sys.executable, "-m", "sweeper.cli", "resume", sweep_id, "--results-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    study = optuna.load_study(study_name=None, storage=f"sqlite:///{tmp_path}/optuna.db")
    reruns = {t.user_attrs["rerun_of"]: t for t in study.trials if "rerun_of" in t.user_attrs}
    assert set(reruns) == killed and all(t.state == TrialState.COMPLETE for t in reruns.values())
    assert all(study.trials[n].state == TrialState.FAIL for n in killed)
    rows = pd.read_csv(summary)
    assert list(rows["status"]) == ["ok"], rows[["status", "failure_message"]]


def test_a_profiled_trial_logs_its_trace_and_times_the_other_steps(tmp_path):
    """trial.profile traces the steps it names (JAX's profiler) and the trace reaches the
    trial's run; the traced steps are left out of the step-time figures."""
    uri = f"memory:{uuid.uuid4().hex}"
    result = run_sweep("smoke", results_dir=tmp_path, tracking_uri=uri, trials=1,
                       set={"trial.steps": 6, "search.remeasure": 0, "trial.profile": {"start_step": 3, "steps": 2},
                            "constraints.convergence": False})  # fmt: skip
    row = result.trials.iloc[0]
    assert row["status"] == "ok" and row["timed_steps"] == 6 - 2 - 2  # warm-up and traced out
    traces = list(Path(row["profile_dir"]).rglob("*.xplane.pb"))
    assert traces, row["profile_dir"]
    # The trace is the sweep storage's copy; Ray's staging copies are cleaned at the end.
    assert Path(row["profile_dir"]).is_relative_to(tmp_path), row["profile_dir"]
    assert not staging_copies(result.study_name)
    run = store_for(uri).read(row["mlflow_run_id"])
    assert any(f.startswith("profile/") and f.endswith(".xplane.pb") for f in run.files)
