"""Every command the CLI prints for its user to run next runs as printed from where the user
stands. After `sweeper show ID --results-dir DIR` from another folder, the printed `sweeper ui
ID` and `sweeper export ID --format maxtext` answered `no sweep 'ID' (latest: none)`, and so
did the `sweeper show` an unknown `--trial` suggests: they lacked the `--results-dir` given."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from sweeper.record.manifest import SweepManifest
from tests.helpers import REPO, free_port, unfolded

# The v5e sweep the chip left (committed), finished; read as interrupted (as it stood for a day
# between calls), `show` prints how to resume it too.
V5E = REPO / "results" / "v5e"
SWEEP = "20261206-180103-144f"


def _env() -> dict[str, str]:
    """The user's environment, with this checkout's code importable from any folder."""
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, "COLUMNS": "100"}


def _sweeper(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "sweeper.cli", *args], capture_output=True,
                          text=True, cwd=cwd, env=_env(), timeout=120)  # fmt: skip


def _printed(text: str) -> list[str]:
    """The `sweeper ...` commands in backquotes in `text` (whatever the program is called)."""
    found = []
    for quoted in re.findall(r"`([^`]+)`", text):
        words = shlex.split(quoted)
        if Path(words[0]).name == "sweeper" or words[1:3] == ["-m", "sweeper"]:
            found.append(quoted)
    return found


def _verb(command: str) -> str:
    words = shlex.split(command)
    return words[3] if words[1:3] == ["-m", "sweeper"] else words[1]


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def test_every_printed_follow_up_runs_as_printed_from_where_the_user_stands(tmp_path):
    sweeps = tmp_path / "sweeps"
    shutil.copytree(V5E, sweeps)
    path = sweeps / "v5e_dense" / SWEEP / "sweep.json"
    manifest = SweepManifest.read(path)
    cut = manifest.ending.model_copy(update={"state": "interrupted"})
    manifest.model_copy(update={"ending": cut}).write(path)
    here = tmp_path / "elsewhere"  # the user's folder: no results of its own
    here.mkdir()
    given = ("--results-dir", str(sweeps))
    shown = _sweeper(here, "show", SWEEP[:8], *given)
    assert shown.returncode == 0, shown.stderr
    no_trial = _sweeper(here, "export", SWEEP, "--trial", "nope", *given)
    assert no_trial.returncode == 2 and "no trial 'nope'" in no_trial.stderr
    no_sweep = _sweeper(here, "show", "19990101", *given)
    assert no_sweep.returncode == 2 and "no sweep '19990101'" in unfolded(no_sweep.stderr)
    commands = _printed(shown.stdout + no_trial.stderr + no_sweep.stderr)
    assert sorted(map(_verb, commands)) == ["export", "list", "resume", "show", "ui"], commands
    # Resumed as printed, the sweep would train a 270M model here: ended, it says so instead
    # (which it can only say once it has found the sweep).
    manifest = SweepManifest.read(sweeps / "v5e_dense" / SWEEP / "sweep.json")
    ended = manifest.ending.model_copy(update={"state": "finished"})
    manifest.model_copy(update={"ending": ended}).write(sweeps / "v5e_dense" / SWEEP / "sweep.json")
    for command in commands:
        words = shlex.split(command)
        verb = _verb(command)
        if verb == "ui":
            if not _port_free(5000):  # the default port is taken here: the one option added
                words += ["--port", str(free_port())]
            _serves(words, here, sweeps)
            continue
        done = subprocess.run(words, capture_output=True, text=True, cwd=here, env=_env(),
                              timeout=120)  # fmt: skip
        assert done.returncode == 0, (command, done.stderr[-2000:])
        assert SWEEP in done.stdout, (command, done.stdout[-2000:])
        if verb == "resume":
            assert "nothing to resume" in done.stdout, done.stdout


def _serves(words: list[str], cwd: Path, sweeps: Path) -> None:
    """`sweeper ui` as printed serves the sweep's runs page (then it is stopped), and each
    trial's artifacts in it: the folder was brought back from the chip, where MLflow wrote
    their absolute paths (they follow it)."""
    ui = subprocess.Popen(words, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          cwd=cwd, env=_env())  # fmt: skip
    try:
        lines = []
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and ui.stdout is not None:
            line = ui.stdout.readline()
            if not line:
                break  # it exited
            lines.append(line)
            if line.startswith("http://127.0.0.1:"):
                break
        ended = not lines or not lines[-1].startswith("http")
        stderr = ui.communicate(timeout=30)[1] if ended else ""
        assert any(x.startswith("http://127.0.0.1:") for x in lines), (lines, stderr[-2000:])
        base = re.match(r"http://127\.0\.0\.1:\d+", lines[-1])[0]
        runs = json.loads((sweeps / "v5e_dense" / SWEEP / "mlflow_runs.json").read_text())["runs"]
        for run_id in list(runs.values())[:3]:
            url = f"{base}/api/2.0/mlflow/artifacts/list?run_id={run_id}"
            with urllib.request.urlopen(url, timeout=30) as answer:
                files = [f["path"] for f in json.load(answer).get("files", [])]
            assert "trial.json" in files, (run_id, files)
    finally:
        ui.terminate()
        ui.wait(timeout=30)


def test_a_sweep_on_a_named_ray_cluster_prints_resume_with_that_address(capsys, monkeypatch):
    """A sweep run with `--address` printed `sweeper resume ID` without it: copied, resume
    started a private Ray on the driver's host instead of going back to the cluster. The
    banner, `show` and the records' notes now name the address it ran with."""
    from sweeper.answer.console import where
    from sweeper.answer.progress import ProgressCallback
    from sweeper.execute import cluster
    from sweeper.space.load import load_space

    monkeypatch.setattr(cluster, "_RAY_ADDRESS", "10.1.2.3:6379")  # as `--address` leaves it
    space = load_space("smoke", {"search.trials": 1})
    given = cluster.given_address()  # what the sweep's driver passes its progress lines
    ProgressCallback(space, SWEEP, str(V5E / "v5e_dense" / SWEEP), given).setup()
    banner = " ".join(capsys.readouterr().err.split())
    assert f"resume {SWEEP} --results-dir" in banner and "--address 10.1.2.3:6379`" in banner
    manifest = SweepManifest.read(V5E / "v5e_dense" / SWEEP / "sweep.json")
    assert manifest.ray_address == ""  # run without Ray: its resume names no cluster
    cut = manifest.ending.model_copy(update={"state": "interrupted"})  # resumable, as it was
    said = where(manifest.model_copy(update={"ray_address": "10.1.2.3:6379", "ending": cut}),
                 V5E / "v5e_dense" / SWEEP)  # fmt: skip
    resume = next(line for line in said if line.startswith("resume:"))
    assert "--address 10.1.2.3:6379`" in resume, resume


def test_a_folder_brought_back_says_its_notes_paths_where_they_now_are(tmp_path):
    """The chip's sweep noted its best's profile at the path the chip wrote it; read from the
    folder brought back, the note names the profile where it now is (it named the chip's)."""
    from sweeper.record.manifest import find_sweep

    shutil.copytree(V5E, tmp_path / "v5e")
    found = find_sweep(SWEEP, tmp_path / "v5e")
    assert found.manifest is not None
    profile = next(n for n in found.manifest.ending.notes if n.startswith("profile:"))
    traced = Path(profile.split("traced its last steps: ")[1].split(" (")[0])
    assert traced.is_dir() and (tmp_path / "v5e") in traced.parents, profile
