"""A sweep without Ray (sweeper/sweep/host.py): on a host that allows no TCP socket, as the
lent TPU v5e's, `sweeper run` runs its trials one at a time on the host, with the same
records, resume and table; and its folder, brought to another host, reads there."""

from __future__ import annotations

import csv
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import optuna
import pytest
from mlflow.tracking import MlflowClient
from optuna.trial import TrialState

from sweeper.execute.host import tcp_refused
from sweeper.record.manifest import find_sweep
from sweeper.space.errors import SpaceError
from sweeper.space.load import load_space
from sweeper.sweep.prepare import choose_executor
from tests.helpers import DATA, REPO

TRIALS = 3
STEPS = 150  # long enough that the driver is killed while the second trial trains


def _no_tcp_env(tmp_path: Path) -> dict[str, str]:
    """This process's environment, less TCP: a sitecustomize refuses AF_INET sockets (as the
    v5e sandbox does); Ray's own folder is one the test can look into."""
    path = os.pathsep.join([str(DATA / "no_tcp"), os.environ.get("PYTHONPATH", "")])
    return {**os.environ, "PYTHONPATH": path, "RAY_TMPDIR": str(tmp_path / "ray_tmp")}


def _sweeper(*args: str) -> list[str]:
    return [sys.executable, "-m", "sweeper.cli", *args]


def _wait_for_second_trial(sweep_glob: Path, results: Path, proc: subprocess.Popen) -> str:
    """The second trial's id, once it is RUNNING and has logged a step in MLflow (the store
    is opened only then: a second process making its tables with the sweep's races it)."""
    client = None
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        found = list(results.glob("smoke/*/host_trials.json"))
        trials = json.loads(found[0].read_text()) if found else []
        if len(trials) == 2 and trials[1]["status"] == "RUNNING":
            runs = json.loads((found[0].parent / "mlflow_runs.json").read_text())["runs"]
            run = runs.get(trials[1]["trial_id"])
            client = client or MlflowClient(f"sqlite:///{results}/mlflow.db")
            if run and client.get_metric_history(run, "loss"):
                return trials[1]["trial_id"]
        time.sleep(0.2)
    out = proc.stdout.read() if proc.stdout and proc.poll() is not None else ""
    raise AssertionError(f"the second trial never trained: {proc.poll()} {out[-2000:]}")


def test_without_tcp_a_sweep_runs_on_the_host_resumes_and_reads_elsewhere(tmp_path):
    results = tmp_path / "results"
    env = _no_tcp_env(tmp_path)
    said = subprocess.run([sys.executable, "-c", "from sweeper.execute.host import tcp_refused;"
                           "print(tcp_refused())"], env=env, capture_output=True, text=True,
                          cwd=REPO)  # fmt: skip
    assert "refused" in said.stdout, said.stderr  # the shim refuses, as the v5e sandbox does
    proc = subprocess.Popen(
        _sweeper("run", "smoke", "--results-dir", str(results), "--trials", str(TRIALS),
                 "--set", "search.remeasure=0", "--set", "search.sampler=random",
                 "--set", f"trial.steps={STEPS}", "--set", "constraints.convergence=false"),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO, env=env,
    )  # fmt: skip
    cut = _wait_for_second_trial(results, results, proc)
    proc.kill()  # the driver dies mid-trial: no handler, no cleanup
    proc.wait(30)
    (sweep_dir,) = results.glob("smoke/*")
    manifest = json.loads((sweep_dir / "sweep.json").read_text())
    assert manifest["executor"] == "host"
    first = json.loads((sweep_dir / "host_trials.json").read_text())[0]
    assert first["status"] == "TERMINATED"
    # Resumed from another folder, as the chip's sweep was (copied there, then resumed): the
    # saved searcher reaches the study where it is now, not where it was written (there
    # SQLite made an empty file and resume ended in "Record does not exist").
    written, results = results, tmp_path / "copied"
    shutil.copytree(written, results)
    shutil.rmtree(written)
    sweep_dir = results / "smoke" / sweep_dir.name

    done = subprocess.run(_sweeper("resume", sweep_dir.name, "--results-dir", str(results)),
                          capture_output=True, text=True, cwd=REPO, env=env, timeout=900)  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    # No Ray was started: it would have made its session folder here.
    assert not (tmp_path / "ray_tmp").exists() or not any((tmp_path / "ray_tmp").rglob("session_*"))
    trials = json.loads((sweep_dir / "host_trials.json").read_text())
    assert [t["status"] for t in trials] == ["TERMINATED"] * TRIALS
    client = MlflowClient(f"sqlite:///{results}/mlflow.db")
    exp = client.get_experiment_by_name("smoke")
    runs = [r for r in client.search_runs([exp.experiment_id])
            if r.data.tags.get("sweeper.kind") == "trial"]  # fmt: skip
    assert len(runs) == TRIALS and {r.info.status for r in runs} == {"FINISHED"}
    attempts = json.loads((sweep_dir / "mlflow_runs.json").read_text())["attempts"]
    assert attempts[cut] == 2 and attempts[first["trial_id"]] == 1  # the first did not rerun
    # Nothing of the sweep's was written where it began (MLflow keeps artifact folders as
    # absolute paths: they follow the folder), and every run's artifacts are here.
    assert not any((written / name).exists() for name in ("optuna.db", "mlflow.db", "mlartifacts"))
    for run in runs:
        assert run.info.artifact_uri.startswith(results.resolve().as_uri() + "/mlartifacts/")
        assert "trial.json" in {a.path for a in client.list_artifacts(run.info.run_id)}
    # The cut trial ran again from its start: every step's loss once more, in one run.
    run_of_cut = next(r for r in runs if r.data.tags["sweeper.trial_id"] == cut)
    steps = sorted({m.step for m in client.get_metric_history(run_of_cut.info.run_id, "loss")})
    assert steps == list(range(STEPS))
    study = optuna.load_study(study_name=manifest["study_name"],
                              storage=f"sqlite:///{results}/optuna.db")  # fmt: skip
    assert sum(t.state == TrialState.COMPLETE for t in study.trials) == TRIALS
    assert all(t.state != TrialState.RUNNING for t in study.trials)
    with open(sweep_dir / "summary.csv") as f:
        rows = list(csv.DictReader(f))
    assert sorted(r["trial_id"] for r in rows) == sorted(t["trial_id"] for t in trials)
    assert {r["status"] for r in rows} == {"ok"}

    # Brought to another host: its folder moved, read with show and report from there.
    moved = tmp_path / "brought_back"
    shutil.move(str(results), moved)
    found = find_sweep(sweep_dir.name, moved)
    assert found.manifest is not None
    assert found.manifest.tracking_uri == f"sqlite:///{moved.resolve()}/mlflow.db"
    assert found.manifest.optuna_storage == f"sqlite:///{moved.resolve()}/optuna.db"
    shown = subprocess.run(_sweeper("show", sweep_dir.name, "--results-dir", str(moved)),
                           capture_output=True, text=True, cwd=tmp_path, timeout=120)  # fmt: skip
    assert shown.returncode == 0 and cut in shown.stdout, shown.stdout + shown.stderr
    report = subprocess.run(_sweeper("report", sweep_dir.name, "--results-dir", str(moved)),
                            capture_output=True, text=True, cwd=tmp_path, timeout=300)  # fmt: skip
    assert report.returncode == 0 and "report.html" in report.stdout, report.stderr
    assert "importance" in (moved / "smoke" / sweep_dir.name / "report.html").read_text().lower()


def test_a_saved_searcher_restored_from_a_moved_folder_uses_the_study_there(tmp_path):
    """Tune restores the searcher from its pickle (the Ray executor's resume): the study it
    asks and tells is the one in the folder as it is now, not where the pickle was made."""
    from sweeper.search.distributions import make_sampler
    from sweeper.search.searcher import SweepSearch, moved_url

    space = load_space("smoke", {"search.trials": 3})
    metric = space.objective.primary.metric

    def searcher(folder: Path) -> SweepSearch:
        return SweepSearch(space, sweep_id="s", metric=metric, mode="max",
                           sampler=make_sampler(space), study_name="s",
                           storage=optuna.storages.RDBStorage(f"sqlite:///{folder}/optuna.db"))  # fmt: skip

    (tmp_path / "a" / "results" / "ray").mkdir(parents=True)
    first = searcher(tmp_path / "a" / "results")
    first.suggest("t0")
    first.save(str(tmp_path / "a" / "results" / "ray" / "searcher.pkl"))
    moved = tmp_path / "b" / "chip"
    moved.parent.mkdir()
    shutil.move(str(tmp_path / "a" / "results"), moved)
    restored = SweepSearch.__new__(SweepSearch)
    restored.restore(str(moved / "ray" / "searcher.pkl"))
    restored.suggest("t1")  # asks (and writes) the study: here, not under a/
    assert not (tmp_path / "a" / "results").exists()
    study = optuna.load_study(study_name="s", storage=f"sqlite:///{moved}/optuna.db")
    assert len(study.trials) == 2
    # Only a database under the folder that moved follows it.
    assert moved_url("sqlite:////x/r/optuna.db", Path("/x/r/s/p.pkl"), Path("/y/q/s/p.pkl")) == (
        "sqlite:////y/q/optuna.db"
    )
    assert moved_url("sqlite:////z/o.db", Path("/x/r/p.pkl"), Path("/y/r/p.pkl")) == (
        "sqlite:////z/o.db"
    )
    assert moved_url("postgresql://h/db", Path("/x/p.pkl"), Path("/y/p.pkl")) == "postgresql://h/db"


def test_auto_runs_without_ray_only_where_ray_cannot_start():
    space = load_space("smoke")
    if tcp_refused() is None:  # this host can start Ray: auto keeps it
        assert choose_executor("auto", space)[0] == "ray"
    assert choose_executor("host", space) == (
        "host",
        ["executor host: trials run one at a time on this host, without Ray"],
    )
    with pytest.raises(SpaceError, match="executor"):
        choose_executor("threads", space)


def test_a_tpu_slice_at_run_fidelity_is_refused_without_ray():
    space = load_space("smoke", {"target": "tpu7x:2x2x2", "fidelity": "run"})
    with pytest.raises(SpaceError, match="whole slices of a Ray cluster") as raised:
        choose_executor("host", space)
    assert raised.value.field == "target"


def test_a_trial_cut_off_reads_killed_not_a_missing_failure_class():
    """A trial cut off by an interrupted sweep has no failure class (the chip's sweep showed
    'killed: nan' in `sweeper show`); its status cell says killed, a failed one its class."""
    import pandas as pd

    from sweeper.answer.console import _cells
    from sweeper.record.row import Column

    killed = pd.Series({Column.TRIAL_ID: "a", Column.STATUS: "killed",
                        Column.FAILURE_CLASS: float("nan")})  # fmt: skip
    failed = pd.Series({Column.TRIAL_ID: "b", Column.STATUS: "failed",
                        Column.FAILURE_CLASS: "oom_hbm"})  # fmt: skip
    assert _cells(killed, "tokens_per_sec_per_chip", False, "mfu")[1] == "killed"
    assert _cells(failed, "tokens_per_sec_per_chip", False, "mfu")[1] == "failed: oom_hbm"


def test_a_sweep_stopped_before_its_first_trial_resumes_without_ray(tmp_path):
    """Without Ray, the searcher is saved as the first trial starts: a driver stopped before
    that (between prepare and the first trial) leaves none, and the resume asks as it would
    have, running the whole sweep."""
    from sweeper.sweep.lifecycle import Sweep
    from sweeper.sweep.run import run_sweep

    results = tmp_path / "results"
    sweep = Sweep.prepare("smoke", results_dir=results, executor="host", trials=1,
                          set={"trial.steps": 3, "search.remeasure": 0,
                               "constraints.convergence": False})  # fmt: skip
    sweep.lock.release()  # the driver is gone before any trial began
    assert not (sweep.sweep_dir / "host_searcher.pkl").exists()
    result = run_sweep(resume=sweep.sweep_id, results_dir=results)
    assert result.counts == {"total": 1, "ok": 1}
    assert json.loads((sweep.sweep_dir / "sweep.json").read_text())["ending"]["state"] == "finished"
