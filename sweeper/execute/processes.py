"""The trainer processes of one trial: a child of this Ray worker, or one per host of a slice.

Both kinds are seen through one handle: `drain()` returns the output lines written since
the last call and the exit code once the process has ended and its output is read;
`kill()` ends the whole process group. A trial's processes never outlive it: each runs in
its own session, dies with its parent (PR_SET_PDEATHSIG), and is killed on any ending.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

from trainer.trial.files import die_with_parent

# Core leases of a Ray node's trials: one folder per node (a private local Ray is a node of its
# own), so trials of one node never share a core and two sweeps' leases never wait on each
# other; what two sweeps on one host do to each other is measured (`cpu_contention`).
CORE_LEASES = Path(tempfile.gettempdir()) / "sweeper-cores"


def lease_folder(node_id: str) -> Path:
    return CORE_LEASES / node_id


class Handle(Protocol):
    where: dict[str, Any]

    def drain(self) -> tuple[list[str], int | None]: ...

    def kill(self) -> None: ...


class TrainerProcess:
    """One `python -m trainer` child in its own process group; a thread reads its output."""

    def __init__(
        self, argv: list[str], env: dict[str, str], log_path: Path, cores: set[int] | None = None
    ):
        def setup() -> None:
            die_with_parent()  # the Ray worker's death (Tune stop, crash) kills it too
            if cores:
                os.sched_setaffinity(0, cores)

        self._log = log_path.open("w", buffering=1)  # line by line: readable while it runs
        self._lines: list[str] = []
        self._lock = threading.Lock()
        self.proc = subprocess.Popen(
            argv,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
            start_new_session=True,  # its own process group, killed whole
            preexec_fn=setup,
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None, "started with stdout=PIPE"
        for line in self.proc.stdout:
            self._log.write(line)
            with self._lock:
                self._lines.append(line)
        self._log.close()

    def drain(self) -> tuple[list[str], int | None]:
        done = not self._reader.is_alive()  # output fully read: the process has closed it
        with self._lock:
            lines, self._lines = self._lines, []
        return lines, (self.proc.wait() if done else None)

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)


class LocalHandle:
    """The trainer as a child of the Tune worker on the driver host."""

    def __init__(self, process: TrainerProcess, where: dict[str, Any]):
        self.process, self.where = process, where

    def drain(self) -> tuple[list[str], int | None]:
        return self.process.drain()

    def kill(self) -> None:
        self.process.kill()


# ------------------------------------------------------------------ local CPU cores


@contextlib.contextmanager
def lease_cores(count: int, node_id: str, timeout_s: float = 60.0) -> Iterator[set[int] | None]:
    """`count` cores of this host no other trial of Ray node `node_id` holds (file locks, freed
    when the holder dies); None when they cannot be had in time (the trainer then runs
    unpinned, and its row says so)."""
    folder = lease_folder(node_id)
    folder.mkdir(parents=True, exist_ok=True)
    cores = sorted(os.sched_getaffinity(0))
    held: dict[int, int] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while count <= len(cores):
            for core in cores:
                if len(held) == count:
                    break
                fd = os.open(folder / f"core-{core}.lock", os.O_CREAT | os.O_RDWR, 0o666)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    held[core] = fd
                except BlockingIOError:
                    os.close(fd)
            if len(held) == count or time.monotonic() > deadline:
                break
            for fd in held.values():
                os.close(fd)
            held.clear()
            time.sleep(0.2)
        yield set(held) if len(held) == count else None
    finally:
        for fd in held.values():
            os.close(fd)
