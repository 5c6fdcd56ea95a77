"""Local trainer processes (sweeper/execute/processes.py): core leases of CPU trials (distinct
cores among one Ray node's trials, never shared host-wide between sweeps; a trial that could
lease none says so), and their logs."""

from __future__ import annotations

import os

import pandas as pd
import pytest

from sweeper.answer.notes import UNPINNED, pinning_notes
from sweeper.execute import processes
from sweeper.record.row import Column


@pytest.fixture
def leases(tmp_path, monkeypatch):
    monkeypatch.setattr(processes, "CORE_LEASES", tmp_path)
    return tmp_path


def test_one_nodes_trials_lease_distinct_cores_and_another_nodes_do_not_wait(leases):
    cores = len(os.sched_getaffinity(0))
    with processes.lease_cores(1, "node-a") as first, processes.lease_cores(1, "node-b") as other:
        assert first and other  # another node's (another sweep's) leases never wait on these
        if cores > 1:
            with processes.lease_cores(1, "node-a", timeout_s=1) as second:
                assert second and not (second & first)
        with processes.lease_cores(cores, "node-a", timeout_s=0.5) as none:
            assert none is None  # every core of node-a is not free while `first` holds one
    assert sorted(p.name for p in leases.iterdir()) == ["node-a", "node-b"]


def test_a_trial_that_leased_no_core_is_marked_and_noted():
    frame = pd.DataFrame(
        {
            Column.TRIAL_ID: ["a", "b"],
            Column.STATUS: ["ok", "ok"],
            Column.CORES: ["0", UNPINNED],
            Column.REMEASURE_OF: ["", ""],
        }
    )
    (note,) = pinning_notes(frame)
    assert note.startswith("unpinned: 1 trial leased") and "(b)" in note
    assert pinning_notes(frame.iloc[:1]) == []


def test_a_running_trainers_log_is_readable_line_by_line(tmp_path):
    """The trial's trainer.log holds each line as the trainer prints it, not once 8 KiB have
    gathered or the trainer has ended: a running trial can be read (tail -f)."""
    import sys
    import time

    from sweeper.execute.processes import TrainerProcess

    script = "import sys, time; print('accepted', flush=True); time.sleep(30)"
    log = tmp_path / "trainer.log"
    process = TrainerProcess([sys.executable, "-c", script], {}, log)
    try:
        deadline = time.monotonic() + 20
        while "accepted" not in log.read_text() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert log.read_text() == "accepted\n"
    finally:
        process.kill()
