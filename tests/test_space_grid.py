"""benchmarks.space_grid, the measured optimum a sweep is held to (on the chip: v5e_dense's
and v5e_moe's grids), on CPU: the same code path, simulated devices, no finding."""

from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _grid(out: Path, *args: str) -> dict[str, dict[str, str]]:
    command = [sys.executable, "-m", "benchmarks.space_grid", "smoke", "--devices", "8",
               "--set", "trial.steps=4", "--out", str(out), *args]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, cwd=REPO, timeout=900)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    with (out / "grid.csv").open() as f:
        return {row["index"]: row for row in csv.DictReader(f)}


def test_a_grid_measures_its_points_and_a_resumed_one_keeps_them(tmp_path):
    """Each point asked for is trained and measured (tokens/s, its convergence check); a grid
    resumed keeps what it measured, figure for figure, and a spent budget starts no point:
    the chip's grid goes on so across its 10-minute calls."""
    out = tmp_path / "grid"
    first = _grid(out, "--only", "0,3")
    assert set(first) == {"0", "3"}
    for row in first.values():
        assert row["status"] == "ok" and float(row["tokens_per_sec_per_chip"]) > 0
        assert row["convergence"] == "True"
    assert first["0"]["remat.policy"] != first["3"]["remat.policy"] or (
        first["0"]["mesh.tensor"] != first["3"]["mesh.tensor"]
    )
    again = _grid(out, "--only", "0,3,4", "--resume", "--budget", "0.001")
    assert {k: again[k]["tokens_per_sec_per_chip"] for k in ("0", "3")} == {
        k: first[k]["tokens_per_sec_per_chip"] for k in ("0", "3")
    }
    assert again["4"]["status"] == "not_run" and "budget" in again["4"]["failure"]
