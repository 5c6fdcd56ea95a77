"""One writer per sweep (sweeper/record/lock.py), and tracking writes kept honestly when the
journal's own file cannot be written (sweeper/record/journal.py)."""

from __future__ import annotations

import errno
import json
import os
import socket
import subprocess
import sys
import time

import pytest

from sweeper.record.journal import TrackingJournal
from sweeper.record.lock import SweepLock, SweepLocked
from tests.helpers import REPO

HOLD = (
    "import sys, time\n"
    "from pathlib import Path\n"
    "from sweeper.record.lock import SweepLock\n"
    "SweepLock(Path(sys.argv[1]), 'S').acquire('sweeper run')\n"
    "print('held', flush=True)\n"
    "time.sleep(600)\n"
)


def test_a_second_driver_of_a_sweep_is_refused_by_name_until_the_first_is_gone(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path)], cwd=REPO,
                              stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        with pytest.raises(SweepLocked, match=f"PID {holder.pid} on {socket.gethostname()}"):
            SweepLock(tmp_path, "S").acquire("sweeper resume")
    finally:
        holder.kill()  # SIGKILL: no release, the kernel drops the lock; the file still says held
        holder.wait()
    assert json.loads((tmp_path / "driver.lock").read_text())["held"] is True
    lock = SweepLock(tmp_path, "S")
    lock.acquire("sweeper resume")  # the dead driver's lock is stale: taken over
    assert lock.holder()["pid"] == os.getpid()
    lock.release()
    assert lock.holder()["held"] is False


def test_a_lock_a_live_process_holds_is_refused_even_where_locks_do_not_reach(tmp_path):
    """On a filesystem whose locks do not reach this host, the file and a live PID tell."""
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        (tmp_path / "driver.lock").write_text(json.dumps(
            {"held": True, "host": socket.gethostname(), "pid": sleeper.pid, "doing": "run"}))  # fmt: skip
        with pytest.raises(SweepLocked, match=f"PID {sleeper.pid}"):
            SweepLock(tmp_path, "S").acquire("sweeper resume")
    finally:
        sleeper.kill()
        sleeper.wait()
    time.sleep(0.1)
    SweepLock(tmp_path, "S").acquire("sweeper resume")  # dead now: stale


def test_a_lock_another_host_holds_is_refused_with_how_to_clear_it(tmp_path):
    (tmp_path / "driver.lock").write_text(
        json.dumps({"held": True, "host": "another-host", "pid": 1, "doing": "sweeper run"})
    )
    with pytest.raises(SweepLocked, match=r"another-host.*if that driver is gone, remove"):
        SweepLock(tmp_path, "S").acquire("sweeper resume")


def test_a_journal_that_cannot_be_written_keeps_its_records_and_says_where(tmp_path, monkeypatch):
    """A results folder turned read-only: the warning once said records waited in
    tracking_journal.json, a file never written. Now they wait in memory and every message
    says so."""
    import sweeper.record.journal as journal_module

    def read_only(path, obj, **_):
        raise OSError(errno.EROFS, "Read-only file system", str(path))

    journal = TrackingJournal(tmp_path / "tracking_journal.json")
    monkeypatch.setattr(journal_module, "write_json", read_only)
    local = journal.append("create_run", name="t", tags={})
    assert local and len(journal) == 1 and not journal.path.exists()
    assert journal.where.startswith("this driver's memory only")
    assert "Read-only file system" in journal.where
    monkeypatch.undo()
    journal.append("log_text", run_id=local, text="x", path="a.txt")
    assert journal.where == str(journal.path) and journal.path.exists()
