"""A sweep's answer, as its user gets it: distinct points, the best trial exported (MaxText's
command line, the environment, a trial config that reruns to the same program), the HTML
report, and `sweeper list / show / ui / resume` on a finished sweep."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time
import urllib.request

import pandas as pd
import pytest
import ray
import yaml

from sweeper.sweep.run import run_sweep
from tests.helpers import REPO, free_port, unfolded
from trainer.trial.config import load_config
from trainer.trial.maxtext import from_maxtext

# One worker runs this module: its module fixture is set up once, not once per worker.
pytestmark = pytest.mark.xdist_group("answer")


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """One smoke sweep of 4 trials, run from another working directory with the default
    results folder; and what the package's own results folder held before it."""
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
             logging_level="ERROR")  # fmt: skip
    package_results = sorted(p.name for p in (REPO / "results").iterdir())
    where = tmp_path_factory.mktemp("elsewhere")
    before = os.getcwd()
    os.chdir(where)
    try:
        result = run_sweep("smoke", trials=4, concurrency=2, set={"trial.steps": 4})
    finally:
        os.chdir(before)
        ray.shutdown()
    return result, where, package_results


def _cli(*args: str, timeout: float = 120, columns: int = 100) -> subprocess.CompletedProcess[str]:
    """The CLI as a user in a `columns`-wide terminal runs it (output captured)."""
    env = {**os.environ, "COLUMNS": str(columns)}
    return subprocess.run([sys.executable, "-m", "sweeper.cli", *args], capture_output=True,
                          text=True, cwd=REPO, timeout=timeout, env=env)  # fmt: skip


def test_a_sweep_writes_where_it_is_run_and_trials_are_distinct_points(finished):
    result, where, package_results = finished
    assert result.sweep_dir.is_relative_to(where / "results")
    assert sorted(p.name for p in (REPO / "results").iterdir()) == package_results
    points = result.trials[[c for c in result.trials.columns if c.startswith("knob:")]]
    assert result.counts["total"] == 4 and len(points.drop_duplicates()) == 4


def test_the_best_trial_exported_as_a_trial_reruns_to_the_same_program(finished, tmp_path):
    result, where, _ = finished
    out = _cli(
        "export", result.sweep_id, "--format", "trial", "--results-dir", str(where / "results")
    )
    assert out.returncode == 0, out.stderr
    config = load_config(json.loads(out.stdout))
    best = result.trials.set_index("trial_id").loc[result.best.trial_id]
    # Self-contained: the devices it ran on, and the cores its sweep pinned it to.
    assert config.num_devices == 8 and config.cpu_cores == len(str(best["cores"]).split(","))
    assert result.best_config == json.loads(json.dumps(result.best_config))  # plain data
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # the config brings them
    rerun = subprocess.run([sys.executable, "-m", "trainer", "--config", "-"], input=out.stdout,
                           capture_output=True, text=True, cwd=REPO, env=env, timeout=600)  # fmt: skip
    events = [json.loads(line) for line in rerun.stdout.splitlines() if line.startswith("{")]
    compiled = next(e for e in events if e["event"] == "compiled")
    assert compiled["program_fingerprint"] == best["program_fingerprint"]
    # Where it reran: as many cores as the sweep gave it, not the host's (the rerun pinned
    # itself; before, it ran on every core and measured another program on another host).
    summary = next(e for e in events if e["event"] == "summary")
    assert summary["hardware"] == best["hardware"], (summary["hardware"], best["hardware"])
    best_yaml = yaml.safe_load((result.sweep_dir / "best.yaml").read_text())
    assert load_config(best_yaml["trial"]) == config  # best.yaml reruns the same winner


def test_the_best_trial_exported_for_maxtext_parses_back_to_its_knobs(finished):
    result, where, _ = finished
    out = _cli(
        "export", result.sweep_id, "--format", "maxtext", "--results-dir", str(where / "results")
    )
    assert out.returncode == 0, out.stderr
    command = out.stdout.split("export LIBTPU_INIT_ARGS=")[1]
    words = shlex.split(command.replace("\\\n", " "))
    args = dict(w.split("=", 1) for w in words if "=" in w and not w.startswith(("$", "'")))
    back = load_config(from_maxtext(args))
    lines = out.stdout.split("# knobs: ")[1].splitlines()  # folded: its lines just under it
    said = [lines[0]]
    for line in lines[1:]:
        if not line.startswith("#   "):
            break
        said.append(line.removeprefix("#   "))
    knobs = dict(word.split("=", 1) for word in " ".join(said).split())
    assert str(back.mesh.tensor) == knobs["mesh.tensor"]
    assert back.remat.policy == knobs["remat.policy"]
    assert max(len(line) for line in out.stdout.splitlines() if line.startswith("#")) <= 80
    assert "data.source" in out.stdout  # what MaxText cannot take is said, not dropped
    env = _cli(
        "export", result.sweep_id, "--format", "env", "--results-dir", str(where / "results")
    )
    assert "XLA_FLAGS=--xla_force_host_platform_device_count=8" in env.stdout


def test_the_report_is_one_offline_file_with_its_plots(finished):
    result, _, _ = finished
    text = (result.sweep_dir / "report.html").read_text()
    assert text.count("<img") >= 5 and text.count("data:image/png;base64,") >= 5
    assert "http://" not in text and "https://" not in text and 'src="//' not in text
    assert "fidelity run (measured) on cpu" in text  # every figure says what it is
    for heading in ("Ranked trials", "The objective against each knob that varied",
                    "Search progress", "Throughput against memory", "Knob importances",
                    "Failure map", "Convergence", "The best points, measured again"):  # fmt: skip
        assert f"<h2>{heading}</h2>" in text
    # One figure per knob that varied; the others stated once.
    from sweeper.answer.report import varied
    from sweeper.answer.table import searched

    knobs = varied(searched(result.trials))
    section = text.split("<h2>The objective against each knob that varied</h2>")[1]
    assert section.split("<h2>")[0].count("<img") == len(knobs) >= 1
    # Memory in the unit it reads in (a CPU trial's device holds MiB, not 0.00 GiB), and the
    # convergence check's tolerance stated.
    memory = result.trials["hbm_per_device_gib"].dropna()
    assert ("memory/device, MiB" in text) == (memory.abs().max() < 1)
    assert "A trial passes when its final loss lies within +-" in text


def test_list_show_and_resume_of_a_finished_sweep(finished):
    result, where, _ = finished
    results = str(where / "results")
    listed = _cli("list", "--results-dir", results)
    assert listed.returncode == 0 and result.sweep_id in listed.stdout
    assert "finished" in listed.stdout and "4/4 ok" in listed.stdout
    shown = _cli("show", result.sweep_id[:15], "--results-dir", results)
    assert shown.returncode == 0 and result.best.trial_id in shown.stdout
    # A 100-column terminal: the table fits it (knobs that never varied in a header line;
    # the notes and paths are single lines the terminal wraps, whole for copying).
    out = shown.stdout.splitlines()
    table_lines = out[out.index(next(x for x in out if x.startswith("best "))) + 1 :]
    table_lines = table_lines[: table_lines.index(next(x for x in table_lines if x.startswith(
        ("note ", "results: "))))]  # fmt: skip
    assert len(table_lines) >= 6 and max(map(len, table_lines)) <= 100, shown.stdout
    rows = [line for line in table_lines if line[:8].isalnum()]
    assert rows[0].startswith(result.best.trial_id), shown.stdout  # the best first
    best_line = rows[0]
    # One best, one figure: the one it ranks by (where it was measured again, the mean of
    # both, in its row's `mean` column), in the table and in the list of sweeps.
    value = result.best.ranking_figure("tokens_per_sec_per_chip")
    assert f"{value:,.1f}" in best_line and f"{value:,.1f}" in listed.stdout
    # The best points measured again show as a second figure on their first trial's row,
    # not as trials of their own.
    table = result.trials
    repeats = table.loc[table["remeasure_of"].fillna("") != "", "trial_id"]
    assert len(repeats) == 2 and "again" in shown.stdout
    assert not [t for t in repeats if t in shown.stdout], shown.stdout
    assert f"sweeper ui {result.sweep_id}" in shown.stdout
    start = time.monotonic()
    resumed = _cli("resume", result.sweep_id, "--results-dir", results)
    assert resumed.returncode == 0 and "nothing to resume" in resumed.stdout
    assert time.monotonic() - start < 30  # it started no Ray
    missing = _cli("show", "19990101-000000-0000", "--results-dir", results)
    assert missing.returncode == 2 and result.sweep_id in missing.stderr  # names the latest


def test_sweeper_ui_serves_the_sweeps_runs_on_loopback(finished):
    result, where, _ = finished
    port = free_port()
    ui = subprocess.Popen(
        [sys.executable, "-m", "sweeper.cli", "ui", result.sweep_id, "--port", str(port),
         "--results-dir", str(where / "results")],
        stdout=subprocess.PIPE, text=True, cwd=REPO,
    )  # fmt: skip
    try:
        url = ""
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and "viewStateShareKey" not in url:
            url = ui.stdout.readline() if ui.stdout else ""
        assert url.startswith(f"http://127.0.0.1:{port}/#/experiments/"), url
        with urllib.request.urlopen(url.strip(), timeout=10) as page:
            assert page.status == 200
        search = urllib.request.Request(
            f"http://127.0.0.1:{port}/ajax-api/2.0/mlflow/runs/search",
            data=json.dumps({"experiment_ids": [result.experiment_id],
                             "filter": f"tags.`sweeper.sweep_id` = '{result.sweep_id}'"}).encode(),
            headers={"Content-Type": "application/json"},
        )  # fmt: skip
        with urllib.request.urlopen(search, timeout=10) as answer:
            runs = json.loads(answer.read())["runs"]
        # The sweep's run and its 4 trials: the best 2 points' second measurements are on
        # their trials' runs, not runs of their own.
        assert len(runs) == 5, [r["info"]["run_name"] for r in runs]
        again = [r for r in runs if any(t["key"] == "remeasured_by" for t in r["data"]["tags"])]
        assert len(again) == 2
        assert all(any(m["key"] == "remeasured_tokens_per_sec_per_chip"
                       for m in r["data"]["metrics"]) for r in again)  # fmt: skip
        assert "workflowType=machine_learning" in url  # MLflow's "Model training" mode
        # Its page stores Model training as the browser's choice where it has none, so links
        # without the parameter (the breadcrumb, the experiments list) stay in it.
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=10) as page:
            assert b"localStorage.setItem('mlflow.workflowType_v1'" in page.read()
    finally:
        ui.terminate()
        ui.wait(timeout=30)
    with pytest.raises(OSError):  # the UI it started stopped with it
        urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5)


def test_the_optuna_dashboard_command_the_cli_prints_serves_the_study(finished):
    """`show` printed `optuna-dashboard sqlite:///...`, which a fresh clone did not have; the
    project now installs it and the CLI prints it by its whole path: run as printed, it
    serves the sweep's study."""
    result, where, _ = finished
    shown = _cli("show", result.sweep_id, "--results-dir", str(where / "results"))
    line = unfolded(shown.stdout.split("Optuna study", 1)[1])  # its lines read as one
    command = shlex.split(line.split("(`", 1)[1].rsplit("`)", 1)[0])
    assert os.path.isabs(command[0]) and command[1] == result.manifest.optuna_storage
    port = free_port()
    dashboard = subprocess.Popen([*command, "--port", str(port), "--quiet"],
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        studies = None
        deadline = time.monotonic() + 60
        while studies is None and time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/studies", timeout=5) as r:
                    studies = json.loads(r.read())["study_summaries"]
            except OSError:
                time.sleep(0.5)
        assert studies is not None, "optuna-dashboard did not answer"
        assert result.manifest.study_name in [s["study_name"] for s in studies]
    finally:
        dashboard.terminate()
        dashboard.wait(timeout=30)


def _copy_of(finished, tmp_path):
    """The finished sweep's folder copied to its own results folder, with a study file of its
    own (the copy's damage does not reach the module's sweep); its MLflow store is shared."""
    import shutil

    from sweeper.record.manifest import SweepManifest

    result, where, _ = finished
    copy = tmp_path / "results" / "smoke" / result.sweep_id
    shutil.copytree(result.sweep_dir, copy)
    shutil.copy(where / "results" / "optuna.db", tmp_path / "results" / "optuna.db")
    manifest = SweepManifest.read(copy / "sweep.json")
    study = f"sqlite:///{tmp_path / 'results' / 'optuna.db'}"
    manifest.model_copy(update={"optuna_storage": study}).write(copy / "sweep.json")
    return result, copy


def test_a_sweep_without_its_summary_is_shown_exported_reported_and_mended_from_mlflow(
    finished, tmp_path
):
    """summary.csv deleted from a finished sweep: `show` once printed an empty table, `export`
    said the best trial did not exist, `resume` said "finished" and left it missing. Each now
    rebuilds the table from the sweep's MLflow runs and says so; resume writes it back."""
    result, copy = _copy_of(finished, tmp_path)
    (copy / "summary.csv").unlink()
    where = ("--results-dir", str(tmp_path / "results"))
    shown = _cli("show", result.sweep_id, *where)
    assert shown.returncode == 0, shown.stderr[-2000:]
    runs = result.counts["total"]  # its 4 trials (the points measured again are on theirs)
    assert f"rebuilt from the sweep's {runs} runs" in shown.stderr, shown.stderr[-2000:]
    assert result.best.trial_id in shown.stdout
    exported = _cli("export", result.sweep_id, "--format", "trial", *where)
    assert exported.returncode == 0, exported.stderr[-2000:]
    assert json.loads(exported.stdout)["steps"] == 4
    reported = _cli("report", result.sweep_id, *where)
    assert reported.returncode == 0, reported.stderr[-2000:]
    resumed = _cli("resume", result.sweep_id, *where)
    assert resumed.returncode == 0 and "written back" in resumed.stdout, resumed.stdout[-2000:]
    rows = pd.read_csv(copy / "summary.csv")
    assert len(rows) == runs and result.best.trial_id in set(rows["trial_id"])
    # The second measurements come back from the trials' runs, as summary.csv had them.
    first = result.trials.set_index("trial_id")["remeasured_tokens_per_sec_per_chip"].dropna()
    back = rows.set_index("trial_id")["remeasured_tokens_per_sec_per_chip"].dropna()
    assert back.round(3).to_dict() == first.round(3).to_dict()


def test_a_sweep_whose_study_file_is_gone_is_reported_without_importances(finished, tmp_path):
    """optuna.db deleted: `report` ended in `KeyError: 'Record does not exist.'`; now the
    report is written and says why its importances are left out."""
    result, copy = _copy_of(finished, tmp_path)
    (tmp_path / "results" / "optuna.db").unlink()
    reported = _cli("report", result.sweep_id, "--results-dir", str(tmp_path / "results"))
    assert reported.returncode == 0, reported.stderr[-2000:]
    assert "knob importances left out" in reported.stderr
    assert "knob importances left out" in (copy / "report.html").read_text()


def test_a_damaged_summary_without_a_reachable_store_is_a_clear_exit_2(finished, tmp_path):
    """Neither summary.csv nor the runs: exit 2 naming the file and the fix, no traceback."""
    from sweeper.record.manifest import SweepManifest

    result, copy = _copy_of(finished, tmp_path)
    (copy / "summary.csv").write_text("\x00garbage")
    manifest = SweepManifest.read(copy / "sweep.json")
    gone = f"sqlite:///{tmp_path / 'nowhere' / 'mlflow.db'}"
    manifest.model_copy(update={"tracking_uri": gone}).write(copy / "sweep.json")
    shown = _cli("show", result.sweep_id, "--results-dir", str(tmp_path / "results"))
    assert shown.returncode == 2, shown.stderr[-2000:]
    assert "summary.csv" in shown.stderr and "Traceback" not in shown.stderr


def test_validate_into_a_closed_pipe_ends_well():
    """`sweeper validate moe_short | head -0`: the reader is gone before the first line. The
    command ended with exit 1 (Click's broken-pipe exit); now its output is dropped and it
    exits 0."""
    proc = subprocess.Popen([sys.executable, "-m", "sweeper.cli", "validate", "moe_short"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=REPO)  # fmt: skip
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # the reader leaves before anything is written
    code = proc.wait(timeout=120)
    assert code == 0, proc.stderr.read().decode()[-2000:]
