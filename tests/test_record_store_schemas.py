"""Two sweeps started at once on a new results folder: the MLflow and Optuna SQLite schemas are
created by one of them at a time (issue 33: one of two failed with "table ... already exists")."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from sweeper.record.tracker import default_tracking_uri

OPEN = """
import sys, time
from pathlib import Path
from sweeper.record.stores import open_stores
results, start = Path(sys.argv[1]), float(sys.argv[2])
time.sleep(max(0.0, start - time.time()))  # both begin at the same instant
open_stores(results, sys.argv[3], f"sqlite:///{results / 'optuna.db'}")
"""


@pytest.mark.parametrize("attempt", range(2))
def test_two_sweeps_opening_a_new_results_folder_at_once_both_succeed(tmp_path, attempt):
    results = tmp_path / "results"
    start = time.time() + 8  # after both have imported MLflow and Optuna
    children = [
        subprocess.Popen(
            [sys.executable, "-c", OPEN, str(results), str(start), default_tracking_uri(results)],
            stderr=subprocess.PIPE,
            text=True,
            cwd=Path(__file__).resolve().parents[1],
        )
        for _ in range(2)
    ]
    errors = [child.communicate(timeout=300)[1] for child in children]
    assert [c.returncode for c in children] == [0, 0], "\n".join(e[-1500:] for e in errors)
    assert (results / "mlflow.db").exists() and (results / "optuna.db").exists()
