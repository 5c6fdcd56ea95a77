"""Faults a long sweep meets, each with real processes: a killed driver, a tracking server
that goes away, a study continued across sweeps."""

from __future__ import annotations

import csv
import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import optuna
import pytest
from mlflow.tracking import MlflowClient
from optuna.trial import TrialState

from tests.helpers import REPO, MlflowServer

TRIALS = 4
STEPS = 200  # the killed trial's steps logged so far leave most of its steps still to run


def _sweeper(*args: str) -> list[str]:
    return [sys.executable, "-m", "sweeper.cli", *args]


def _finished(*args: str, timeout: float) -> subprocess.CompletedProcess:
    """`sweeper ARGS` run to its end, its output captured."""
    return subprocess.run(
        _sweeper(*args), capture_output=True, text=True, cwd=REPO, timeout=timeout
    )


def _start(tmp_path: Path, *args: str) -> subprocess.Popen:
    return subprocess.Popen(
        _sweeper("run", "smoke", "--results-dir", str(tmp_path), "--set", "search.remeasure=0", *args),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO,
    )  # fmt: skip


def _wait_for(proc: subprocess.Popen, text: str, lines: list[str]) -> None:
    """Reads the sweep's lines until one says `text`: a line folded to the terminal's width
    (its rest indented below it) is read as one."""
    for line in proc.stdout:
        if line.startswith("  ") and lines:
            lines[-1] = f"{lines[-1].rstrip()} {line.strip()}\n"
        else:
            lines.append(line)
        if text in lines[-1]:
            return
    raise AssertionError(f"sweep ended before {text!r}:\n" + "".join(lines[-40:]))


def _wait_until_training(client: MlflowClient, proc: subprocess.Popen) -> None:
    """Returns once a RUNNING trial has logged a loss: a trial cut off mid-training, not one
    that a fixed sleep may let finish (a warm compile cache makes a trial a few seconds)."""
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        running = [
            r for r in _children(client, "smoke") if r.info.status == "RUNNING"
        ] if client.get_experiment_by_name("smoke") else []  # fmt: skip
        if any(client.get_metric_history(r.info.run_id, "loss") for r in running):
            return
        time.sleep(0.1)
    raise AssertionError("no running trial logged a loss")


def _children(client: MlflowClient, experiment: str) -> list:
    exp = client.get_experiment_by_name(experiment)
    return [
        r
        for r in client.search_runs([exp.experiment_id], max_results=1000)
        if r.data.tags.get("sweeper.kind") == "trial"
    ]


def _summary(sweep_dir: Path) -> list[dict[str, str]]:
    with open(sweep_dir / "summary.csv") as f:
        return list(csv.DictReader(f))


def test_a_killed_driver_resumes_with_nothing_lost_or_repeated(tmp_path):
    # Grid: every trial is a distinct point, so nothing is reused and each trial runs.
    proc = _start(tmp_path, "--trials", str(TRIALS), "--concurrency", "1",
                  "--set", "search.sampler=grid", "--set", f"trial.steps={STEPS}",
                  "--set", "constraints.convergence=false")  # fmt: skip
    lines: list[str] = []
    _wait_for(proc, f"2/{TRIALS} done", lines)
    _wait_for(proc, "started", lines)
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    _wait_until_training(client, proc)  # the third trial has logged its first steps...
    proc.kill()  # ...when the driver is SIGKILLed: no handler, no cleanup
    proc.wait(30)
    (sweep_dir,) = tmp_path.glob("smoke/*")
    before = {r.data.tags["sweeper.trial_id"]: r for r in _children(client, "smoke")}
    finished_before = {t: r.info.end_time for t, r in before.items() if r.info.status == "FINISHED"}
    assert len(finished_before) == 2 and "RUNNING" in {r.info.status for r in before.values()}

    done = _finished("resume", sweep_dir.name, "--results-dir", str(tmp_path), timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    runs = _children(client, "smoke")
    by_trial = {r.data.tags["sweeper.trial_id"]: r for r in runs}
    # Nothing lost: every trial has exactly one child run, FINISHED, with its metrics.
    assert len(runs) == len(by_trial) == TRIALS
    assert {r.info.status for r in runs} == {"FINISHED"}
    assert all(r.data.metrics["tokens_per_sec_per_chip"] > 0 for r in runs)
    parent = client.get_run(json.loads((sweep_dir / "sweep.json").read_text())["parent_run_id"])
    assert parent.info.status == "FINISHED" and parent.data.metrics["trials_ok"] == TRIALS
    # Nothing repeated: the trials that had finished were not run (nor written) again.
    for trial_id, end_time in finished_before.items():
        assert by_trial[trial_id].info.end_time == end_time
    attempts = json.loads((sweep_dir / "mlflow_runs.json").read_text())["attempts"]
    cut = [t for t in before if t not in finished_before]
    assert all(attempts[t] == 2 for t in cut) and all(attempts[t] == 1 for t in finished_before)
    # The interrupted trial ran again from the start: its loss history has every step once more.
    (rerun,) = cut
    history = client.get_metric_history(by_trial[rerun].info.run_id, "loss")
    assert sorted({m.step for m in history}) == list(range(STEPS))
    # No Optuna trial is left RUNNING; each Tune trial completed once.
    study = optuna.load_study(
        study_name=f"smoke-{sweep_dir.name}", storage=f"sqlite:///{tmp_path}/optuna.db"
    )
    assert all(t.state != TrialState.RUNNING for t in study.trials)
    assert sum(t.state == TrialState.COMPLETE for t in study.trials) == TRIALS
    # The summary is rebuilt from the durable records: all four trials, the best among them.
    rows = _summary(sweep_dir)
    assert sorted(r["trial_id"] for r in rows) == sorted(by_trial)
    assert {r["status"] for r in rows} == {"ok"}
    assert (sweep_dir / "best.yaml").exists()


@pytest.mark.slow  # 1.5-2.5 min; a killed driver's resume: the test before, by default
def test_a_driver_killed_while_the_best_point_is_measured_again_resumes_that_measurement(
    tmp_path,
):
    """The re-measurement of the best point (issue 32, item 5) is a Tune trial with no Optuna
    trial: a driver SIGKILLed while it runs resumes it, runs it once more from the start,
    and ends with one re-measurement beside the point's first figure and no Optuna trial
    made for it."""
    proc = subprocess.Popen(
        _sweeper("run", "smoke", "--results-dir", str(tmp_path), "--trials", "2",
                 "--concurrency", "1", "--set", "search.remeasure=1",
                 "--set", "search.sampler=grid", "--set", f"trial.steps={STEPS}",
                 "--set", "constraints.convergence=false"),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO,
    )  # fmt: skip
    lines: list[str] = []
    again = None  # the banner says "measured again" too: the trial's own line is wanted
    while again is None:
        _wait_for(proc, "measured again", lines)  # both search trials ended; the best runs again
        again = re.search(r"started (\w+): (\w+) measured again", lines[-1])
    (cut, original) = again.groups()
    _wait_for(proc, f"{cut} training", lines)
    proc.kill()
    proc.wait(30)
    (sweep_dir,) = tmp_path.glob("smoke/*")
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    assert not any("remeasured_by" in r.data.tags for r in _children(client, "smoke"))

    done = _finished("resume", sweep_dir.name, "--results-dir", str(tmp_path), timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    said = " ".join((done.stdout + done.stderr).split())  # unfolded
    assert f"again {original}: " in said and f"by {cut}" in said, said[-3000:]
    # One run per point, the second measurement on the first's run; none for the repeat.
    runs = {r.data.tags["sweeper.trial_id"]: r for r in _children(client, "smoke")}
    assert {r.info.status for r in runs.values()} == {"FINISHED"} and len(runs) == 2
    assert runs[original].data.tags["remeasured_by"] == cut
    ids = json.loads((sweep_dir / "mlflow_runs.json").read_text())
    assert ids["attempts"][cut] == 2 and ids["repeats"] == {cut: original}  # run again, once
    study = optuna.load_study(
        study_name=f"smoke-{sweep_dir.name}", storage=f"sqlite:///{tmp_path}/optuna.db"
    )
    assert [t.state for t in study.trials] == [TrialState.COMPLETE] * 2  # none for the repeat
    rows = {r["trial_id"]: r for r in _summary(sweep_dir)}
    assert rows[cut]["status"] == "ok" and rows[cut]["remeasure_of"] == original
    assert rows[cut]["attempts"] == "2"
    assert (
        float(rows[original]["remeasured_tokens_per_sec_per_chip"])
        == pytest.approx(runs[original].data.metrics["remeasured_tokens_per_sec_per_chip"])
        == pytest.approx(float(rows[cut]["tokens_per_sec_per_chip"]))
    )


@pytest.mark.slow  # 2 min; outage journaled, replayed: test_record_stores
def test_a_tracking_server_outage_is_journaled_and_replayed(tmp_path):
    server = MlflowServer(tmp_path / "server")
    uri = server.start()
    try:
        proc = _start(tmp_path, "--trials", "3", "--concurrency", "1", "--tracking-uri", uri,
                      "--set", "search.sampler=grid", "--set", "trial.steps=30",
                      "--set", "constraints.convergence=false")  # fmt: skip
        lines: list[str] = []
        _wait_for(proc, "started", lines)
        server.stop(sig=signal.SIGKILL)  # the store vanishes while the first trial runs
        _wait_for(proc, "1/3 done", lines)  # ...and the sweep goes on without it
        time.sleep(5)
        server.start()  # same port, same store
        out, _ = proc.communicate(timeout=900)
        out = "".join(lines) + out
        assert proc.returncode == 0, out[-4000:]
        # Said once, not once per call; and the sweep's notes say what was survived.
        assert out.count("unreachable") == 1 and "all replayed" in out, out[-4000:]
        client = MlflowClient(uri)
        runs = _children(client, "smoke")
        assert len(runs) == 3 and {r.info.status for r in runs} == {"FINISHED"}
        for run in runs:  # every trial's metrics, steps and artifacts reached the store
            assert run.data.metrics["tokens_per_sec_per_chip"] > 0
            steps = {m.step for m in client.get_metric_history(run.info.run_id, "loss")}
            assert steps == set(range(30))
            assert "trial.json" in {a.path for a in client.list_artifacts(run.info.run_id)}
        (journal,) = tmp_path.glob("smoke/*/tracking_journal.json")
        assert json.loads(journal.read_text())["pending"] == []
    finally:
        server.stop()


@pytest.mark.slow  # 1.5 min; --study's reuse is tested here alone: make test-slow
def test_a_study_continues_across_sweeps_and_measured_points_are_reused(tmp_path):
    common = ["--study", "shared", "--set", "trial.steps=3", "--set", "constraints.convergence=false",
              "--set", "search.remeasure=0",
              "--set", "knobs.remat.policy.values=[full]"]  # fmt: skip
    first = _finished(
        "run",
        "smoke",
        "--results-dir",
        str(tmp_path),
        "--trials",
        "2",
        "--set",
        "search.sampler=grid",
        *common,
        timeout=600,
    )
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    second = _finished(
        "run",
        "smoke",
        "--results-dir",
        str(tmp_path),
        "--trials",
        "3",
        "--set",
        "search.sampler=random",
        *common,
        timeout=600,
    )
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    study = optuna.load_study(study_name="shared", storage=f"sqlite:///{tmp_path}/optuna.db")
    # Draws of a point the second sweep already had never reach the study: each is once.
    trials = study.trials
    assert len(trials) == 4 and all(t.state == TrialState.COMPLETE for t in trials)
    first_values = {t.params["mesh.tensor"]: t.value for t in trials[:2]}
    for trial in trials[2:]:  # the grid measured every point: the second sweep ran none
        assert trial.user_attrs["reused_from"] in (0, 1)
        assert trial.value == first_values[trial.params["mesh.tensor"]]
    sweeps = sorted(tmp_path.glob("smoke/*"), key=lambda p: p.name)
    rows = _summary(sweeps[-1])
    # Three trials asked, two points in the space: each reused once, and the sweep says so.
    assert len(rows) == 2 and all(r["reused_from"] != "" and r["pids"] == "" for r in rows)
    assert "ran out of new points" in second.stdout

    # A study asked different questions is refused before any trial, naming the knob.
    changed = _finished(
        "run",
        "smoke",
        "--results-dir",
        str(tmp_path),
        "--study",
        "shared",
        "--set",
        "knobs.mesh.tensor.values=[1, 4]",
        timeout=300,
    )
    assert changed.returncode == 2
    assert "knobs.mesh.tensor" in changed.stderr.replace("\n", " "), changed.stderr


def test_resuming_an_unknown_sweep_is_a_clear_exit_2(tmp_path):
    proc = _finished("resume", "20990101-000000-dead", "--results-dir", str(tmp_path), timeout=300)
    assert proc.returncode == 2
    assert "SWEEP_ID: no sweep '20990101-000000-dead'" in proc.stderr.replace("\n", " ")


def test_a_full_results_folder_at_the_end_closes_every_run_and_resume_finishes_it(
    tmp_path, monkeypatch
):
    """The results folder fills while the sweep writes its end (ENOSPC injected at the
    report's write, as a full tmpfs raised it by hand): the summary written before stays
    whole, nothing half-written or temporary is left, every MLflow run is closed (the sweep's
    KILLED), the error names what was not written and `sweeper resume`; sweep.json gets no
    ending, so resume, once there is room, writes the report and ends the sweep."""
    import errno

    import ray

    from sweeper.answer import report
    from sweeper.record.manifest import SweepManifest
    from sweeper.sweep.result import ResultsUnwritable
    from sweeper.sweep.run import run_sweep

    def full(path, text, **_):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(report, "write_text", full)
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
             logging_level="ERROR")  # fmt: skip
    try:
        try:
            run_sweep("smoke", results_dir=tmp_path, trials=1,
                      set={"trial.steps": 3, "search.remeasure": 0,
                           "constraints.convergence": False})  # fmt: skip
            raise AssertionError("a full results folder was not reported")
        except ResultsUnwritable as exc:
            message = str(exc)
        assert "report.html: No space left on device" in message, message
        sweep_dir = next(tmp_path.glob("smoke/*"))
        assert f"sweeper resume {sweep_dir.name}" in message
        assert (sweep_dir / "summary.csv").read_text().count("\n") == 2  # header and the trial
        assert not (sweep_dir / "report.html").exists() and not list(sweep_dir.glob("*.tmp"))
        assert SweepManifest.read(sweep_dir / "sweep.json").ending.state == "running"
        client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
        runs = client.search_runs(client.search_experiments()[0].experiment_id)
        assert {r.data.tags["sweeper.kind"]: r.info.status for r in runs} == {
            "sweep": "KILLED", "trial": "FINISHED"
        }  # fmt: skip
        monkeypatch.undo()  # room again
        resumed = run_sweep(resume=sweep_dir.name, results_dir=tmp_path)
    finally:
        ray.shutdown()
    assert resumed.counts == {"total": 1, "ok": 1} and len(resumed.trials) == 1
    assert (sweep_dir / "report.html").exists()
    assert SweepManifest.read(sweep_dir / "sweep.json").ending.state == "finished"


def _cut_tune_state(sweep_dir: Path, results: Path) -> Path:
    """Tune's newest state file in the sweep's storage cut to half, as a full disk cut it."""
    experiment = results / "ray" / f"smoke-{sweep_dir.name}"
    state = sorted(experiment.glob("experiment_state-*.json"))[-1]
    data = state.read_bytes()
    state.write_bytes(data[: len(data) // 2])
    return experiment


def test_a_cut_tune_state_is_mended_from_rays_copy_or_the_resume_is_refused(tmp_path, monkeypatch):
    """A results folder that fills mid-sweep cuts Tune's copy of its state; given that,
    Tune's restore starts the experiment afresh, and resume once called the sweep complete with
    1 of its 3 trials. Now the cut copy is mended from Ray's staging copy; with that gone too,
    resume refuses by name, listing the trials Optuna and MLflow hold, and leaves no run open."""
    import errno
    import shutil

    import pytest
    import ray

    from sweeper.answer import report
    from sweeper.execute.tune_state import staging_copies
    from sweeper.record.manifest import SweepManifest
    from sweeper.space.errors import SpaceError
    from sweeper.space.load import load_space
    from sweeper.sweep.result import ResultsUnwritable
    from sweeper.sweep.run import run_sweep

    def full(path, text, **_):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(report, "write_text", full)  # the sweep stays unfinished
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
             logging_level="ERROR")  # fmt: skip
    try:
        with pytest.raises(ResultsUnwritable):
            run_sweep("smoke", results_dir=tmp_path, trials=2,
                      set={"trial.steps": 3, "search.remeasure": 0,
                           "constraints.convergence": False})  # fmt: skip
        sweep_dir = next(tmp_path.glob("smoke/*"))
        before = _summary(sweep_dir)
        assert len(before) == 2
        experiment = _cut_tune_state(sweep_dir, tmp_path)
        with pytest.raises(ResultsUnwritable):  # the report still cannot be written
            run_sweep(resume=sweep_dir.name, results_dir=tmp_path)
        # Mended: both trials kept, neither run again (a fresh start would have run two more).
        assert sorted(r["trial_id"] for r in _summary(sweep_dir)) == sorted(
            r["trial_id"] for r in before
        )
        study = optuna.load_study(study_name=f"smoke-{sweep_dir.name}",
                                  storage=f"sqlite:///{tmp_path}/optuna.db")  # fmt: skip
        assert len(study.trials) == 2
        _cut_tune_state(sweep_dir, tmp_path)
        for staging in staging_copies(experiment.name):
            shutil.rmtree(staging)
        monkeypatch.undo()
        with pytest.raises(SpaceError) as refused:
            run_sweep(resume=sweep_dir.name, results_dir=tmp_path)
    finally:
        ray.shutdown()
    message = str(refused.value)
    assert "experiment_state-" in message and "cut short" in message, message
    assert "(2 trials)" in message
    for row in before:
        assert f"{row['trial_id']} (Optuna #" in message and "COMPLETE" in message
    assert f"--study smoke-{sweep_dir.name}" in message
    # The command it prints names the space as it ran (no `<the space of ...>` to fill in) and
    # the results folder that holds the study.
    assert f"run {sweep_dir / 'space.yaml'} --study" in message and "--results-dir" in message
    assert load_space(str(sweep_dir / "space.yaml")).name == "smoke"
    assert SweepManifest.read(sweep_dir / "sweep.json").ending.state == "running"
    assert len(optuna.load_study(study_name=f"smoke-{sweep_dir.name}",
                                 storage=f"sqlite:///{tmp_path}/optuna.db").trials) == 2  # fmt: skip
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    runs = client.search_runs(client.search_experiments()[0].experiment_id)
    assert "RUNNING" not in {r.info.status for r in runs}


@pytest.mark.slow  # a minute; records closed on a store's fault: the full-folder test
def test_a_study_file_removed_mid_sweep_ends_it_with_every_run_closed(tmp_path):
    """optuna.db deleted while the sweep runs (SQLite: "attempt to write a readonly
    database"): the sweep ends with that error told as a store that took no more writes, no
    MLflow run is left RUNNING (before, the trial's and the sweep's stayed RUNNING forever), and
    resume says the study is gone, naming it, instead of a KeyError traceback."""
    import pytest
    import ray
    from ray import tune

    from sweeper.cli.app import disk_full
    from sweeper.space.errors import SpaceError
    from sweeper.sweep.run import run_sweep

    class RemoveTheStudy(tune.Callback):
        def on_trial_complete(self, iteration, trials, trial, **info):
            (tmp_path / "optuna.db").unlink(missing_ok=True)

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
             logging_level="ERROR")  # fmt: skip
    try:
        with pytest.raises(Exception) as ended:
            run_sweep("smoke", results_dir=tmp_path, trials=3, callbacks=[RemoveTheStudy()],
                      set={"trial.steps": 3, "search.remeasure": 0, "search.concurrency": 1,
                           "constraints.convergence": False})  # fmt: skip
    finally:
        ray.shutdown()
    assert disk_full(ended.value) == "read-only database", repr(ended.value)
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    runs = client.search_runs(client.search_experiments()[0].experiment_id)
    statuses = {(r.data.tags["sweeper.kind"], r.info.status) for r in runs}
    assert ("sweep", "KILLED") in statuses and not any(s == "RUNNING" for _, s in statuses)
    sweep_id = next(tmp_path.glob("smoke/*")).name
    resumed = _finished("resume", sweep_id, "--results-dir", str(tmp_path), timeout=300)
    assert resumed.returncode == 2, resumed.stderr[-3000:]
    assert f"Optuna study 'smoke-{sweep_id}' is not in" in resumed.stderr
    with pytest.raises(SpaceError):  # the Python API says the same
        run_sweep(resume=sweep_id, results_dir=tmp_path)


def test_ctrl_c_between_trials_is_an_interruption_and_resume_runs_the_rest(tmp_path):
    """Ctrl-C while no trial runs (one ended, the next not started): the sweep was called
    finished with exit 0 and the unstarted trial listed as "stopped early by the scheduler"
    (seen on a compile sweep of the 70B space). Now it is interrupted, the unstarted trial has
    no row, and resume runs it."""
    import os
    import signal

    import ray
    from ray import tune

    from sweeper.record.manifest import SweepManifest
    from sweeper.sweep.run import run_sweep

    class CtrlC(tune.Callback):
        def on_trial_complete(self, iteration, trials, trial, **info):
            os.kill(os.getpid(), signal.SIGINT)  # Tune's handler: the experiment stops

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
             logging_level="ERROR")  # fmt: skip
    try:
        first = run_sweep("smoke", results_dir=tmp_path, trials=2, callbacks=[CtrlC()],
                          set={"trial.steps": 3, "search.remeasure": 0, "search.concurrency": 1,
                               "search.sampler": "grid", "constraints.convergence": False})  # fmt: skip
        assert first.interrupted and list(first.trials["status"]) == ["ok"], first.trials
        assert SweepManifest.read(first.sweep_dir / "sweep.json").ending.state == "interrupted"
        resumed = run_sweep(resume=first.sweep_id, results_dir=tmp_path)
    finally:
        ray.shutdown()
    assert not resumed.interrupted and resumed.counts == {"total": 2, "ok": 2}, resumed.counts


def test_a_full_disk_anywhere_in_an_errors_chain_is_told_as_such():
    """What a sweep on a full tmpfs raised by hand: SQLite's "database or disk is full" under
    Optuna's StorageInternalError, and ENOSPC; any other failure is not a full disk."""
    import errno
    import sqlite3

    from sweeper.cli.app import disk_full

    try:
        try:
            raise sqlite3.OperationalError("database or disk is full")
        except sqlite3.OperationalError as inner:
            raise optuna.exceptions.StorageInternalError("raised during the commit") from inner
    except optuna.exceptions.StorageInternalError as exc:
        assert disk_full(exc) == "database or disk is full"
    assert disk_full(OSError(errno.ENOSPC, "No space left on device")) == "No space left on device"
    assert disk_full(OSError(errno.ENOENT, "No such file or directory")) is None
    assert disk_full(ValueError("something else")) is None


def _listening(pid: int) -> dict[tuple[str, str], int]:
    """(process name, address) -> port of every listening socket of `pid` and its descendants."""
    import psutil

    found: dict[tuple[str, str], int] = {}
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return found
    for proc in procs:
        try:
            for conn in proc.net_connections(kind="inet"):
                if conn.status == psutil.CONN_LISTEN:
                    found[(proc.name(), conn.laddr.ip)] = conn.laddr.port
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


def _loopback(address: str) -> bool:
    import ipaddress

    ip = ipaddress.ip_address(address)
    mapped = getattr(ip, "ipv4_mapped", None)
    return (mapped or ip).is_loopback


@pytest.mark.slow  # 2 min; resume after interrupts: Ctrl-C, SIGTERM tests
def test_a_sweep_stopped_twice_listens_on_loopback_only_and_stays_resumable(tmp_path):
    """During a local sweep every server Ray starts (GCS, raylet, workers, agents) listens on
    loopback only (it listened on every interface, its metrics answering other hosts). While
    the driver runs, a second driver of the same sweep is refused by name. A second Ctrl-C
    stopped the sweep saying "nothing was run" while trials trained, with no resume command,
    sweep.json `running` and Optuna trials RUNNING; now it says what ran and how to resume,
    every record is closed as killed, and resume finishes it."""
    proc = _start(tmp_path, "--trials", "3", "--concurrency", "1", "--set", "trial.steps=400",
                  "--set", "constraints.convergence=false", "--set", "search.sampler=grid")  # fmt: skip
    lines: list[str] = []
    _wait_for(proc, "started", lines)
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    sockets: dict[tuple[str, str], int] = {}
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and not any(
        r.info.status == "RUNNING" and client.get_metric_history(r.info.run_id, "loss")
        for r in (_children(client, "smoke") if client.get_experiment_by_name("smoke") else [])
    ):
        sockets.update(_listening(proc.pid))
        time.sleep(0.2)
    sockets.update(_listening(proc.pid))
    names = {name for name, _ in sockets}
    assert {"gcs_server", "raylet"} <= names, sockets  # the probe saw Ray's servers
    assert [k for k in sockets if not _loopback(k[1])] == [], sockets
    (sweep_dir,) = tmp_path.glob("smoke/*")
    second = _finished("resume", sweep_dir.name, "--results-dir", str(tmp_path), timeout=120)
    assert second.returncode == 2 and f"PID {proc.pid}" in second.stderr, second.stderr[-2000:]
    proc.send_signal(signal.SIGINT)
    time.sleep(1.0)
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 130, out[-3000:]
    assert f"sweeper resume {sweep_dir.name}" in out and "nothing was run" not in out, out[-3000:]
    from sweeper.record.manifest import SweepManifest

    assert SweepManifest.read(sweep_dir / "sweep.json").ending.state == "interrupted"
    study = optuna.load_study(study_name=f"smoke-{sweep_dir.name}",
                              storage=f"sqlite:///{tmp_path}/optuna.db")  # fmt: skip
    assert all(t.state != TrialState.RUNNING for t in study.trials)
    assert "RUNNING" not in {r.info.status for r in _children(client, "smoke")}
    done = _finished("resume", sweep_dir.name, "--results-dir", str(tmp_path), timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert {r["status"] for r in _summary(sweep_dir)} == {"ok"} and len(_summary(sweep_dir)) == 3


@pytest.mark.slow  # a minute; a lost Tune state refused by name: the cut-state test
def test_a_lost_tune_state_before_any_trial_ended_is_refused_by_name(tmp_path):
    """Tune's state cut and Ray's copy gone while no trial had ended yet: resume once started
    the experiment afresh, ran one trial and called the sweep complete; the trials cut off
    never ran and were missing from summary.csv. Now it refuses, naming them."""
    import shutil

    from sweeper.execute.tune_state import staging_copies

    proc = _start(tmp_path, "--trials", "2", "--concurrency", "1", "--set", "trial.steps=400",
                  "--set", "constraints.convergence=false")  # fmt: skip
    lines: list[str] = []
    _wait_for(proc, "started", lines)
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    _wait_until_training(client, proc)
    time.sleep(3)  # Tune saves its state every 2 s: one save knows the running trial
    proc.kill()
    proc.wait(30)
    (sweep_dir,) = tmp_path.glob("smoke/*")
    experiment = _cut_tune_state(sweep_dir, tmp_path)
    for staging in staging_copies(experiment.name):
        shutil.rmtree(staging)
    refused = _finished("resume", sweep_dir.name, "--results-dir", str(tmp_path), timeout=300)
    assert refused.returncode == 2, refused.stdout[-2000:] + refused.stderr[-2000:]
    (trial,) = [r.data.tags["sweeper.trial_id"] for r in _children(client, "smoke")]
    assert trial in refused.stderr and "is not resumed" in refused.stderr, refused.stderr[-2000:]
    assert "RUNNING" not in {r.info.status for r in _children(client, "smoke")}


def test_a_sweep_whose_output_pipe_closes_runs_to_its_end(tmp_path):
    """`sweeper run ... | head -4`: the reader leaves after four lines. The driver died at the
    fifth, leaving sweep.json `running`; now its output is dropped and the sweep ends well."""
    proc = _start(tmp_path, "--trials", "2", "--set", "trial.steps=3",
                  "--set", "constraints.convergence=false")  # fmt: skip
    assert proc.stdout is not None
    for _ in range(4):
        proc.stdout.readline()
    proc.stdout.close()
    assert proc.wait(timeout=600) == 0
    from sweeper.record.manifest import SweepManifest

    (sweep_dir,) = tmp_path.glob("smoke/*")
    ending = SweepManifest.read(sweep_dir / "sweep.json").ending
    assert ending.state == "finished" and ending.counts == {"total": 2, "ok": 2}, ending


def test_a_searchers_save_cut_mid_write_is_not_tunes_state(tmp_path):
    """A Ctrl-C while Tune saves its searcher leaves `.<uuid>-tmp-searcher-state-*.pkl`, empty;
    Tune renames that file once whole and never reads it (ray/tune/search/searcher.py), so it
    does not make the state unreadable: resume once refused a sweep over it."""
    import pickle

    from sweeper.execute.tune_state import problems

    session = "2026-12-06_20-29-46"
    (tmp_path / f"experiment_state-{session}.json").write_text(json.dumps({"trials": []}))
    (tmp_path / f"searcher-state-{session}.pkl").write_bytes(pickle.dumps({"study": 1}))
    (tmp_path / f".0b1c-tmp-searcher-state-{session}.pkl").write_bytes(b"")
    assert problems(tmp_path) == []
    (tmp_path / f"searcher-state-{session}.pkl").write_bytes(b"")  # Tune's own file, cut
    assert problems(tmp_path) and "searcher-state" in problems(tmp_path)[0]
