"""One writer per sweep: a lock in the sweep's folder, held by the driver that runs or resumes
it, released when that driver ends (the kernel releases it if the driver is killed). A second
`run` or `resume` of the same sweep is refused by name while the first lives; a lock whose
driver is gone (its PID dead on this host) is stale and taken over."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
from pathlib import Path
from typing import IO, Any

from sweeper.space.errors import SpaceError

LOCK = "driver.lock"  # in the sweep folder


class SweepLocked(SpaceError):
    """Another live driver runs or resumes this sweep."""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    return True


class SweepLock:
    """The lock of one sweep folder, held from `acquire()` to `release()` (or the end of the
    process). Its file names the holder: host, PID, what it runs, since when."""

    def __init__(self, sweep_dir: Path, sweep_id: str):
        self.path = sweep_dir / LOCK
        self.sweep_id = sweep_id
        self._handle: IO[str] | None = None

    def holder(self) -> dict[str, Any]:
        try:
            said = json.loads(self.path.read_text() or "{}")
        except (OSError, ValueError):
            return {}
        return said if isinstance(said, dict) else {}

    def acquire(self, doing: str) -> None:
        """Hold the sweep for this driver; SweepLocked naming the holder when another live
        driver holds it (on this host, by its lock; on another host, by what its file says)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        handle = open(self.path, "a+")  # noqa: SIM115 - held open for the lock's lifetime
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.close()
            self._refuse(self.holder())
        said = self.holder()
        here = socket.gethostname()
        pid = said.get("pid")
        if (
            said.get("held")
            and said.get("host") == here
            and isinstance(pid, int)
            and (pid != os.getpid() and _alive(pid))
        ):  # a filesystem whose locks do not reach here: the file and the PID tell
            handle.close()
            self._refuse(said)
        if said.get("held") and said.get("host") != here:
            # Another host's driver (shared storage): its liveness cannot be read from here.
            handle.close()
            self._refuse(said, elsewhere=True)
        handle.seek(0)
        handle.truncate()
        handle.write(json.dumps({"held": True, "host": here, "pid": os.getpid(),
                                 "doing": doing, "sweep_id": self.sweep_id}))  # fmt: skip
        handle.flush()
        self._handle = handle

    def _refuse(self, said: dict[str, Any], elsewhere: bool = False) -> None:
        who = f"PID {said.get('pid', '?')} on {said.get('host', '?')} ({said.get('doing', '?')})"
        fix = (
            f"if that driver is gone, remove {self.path} and try again"
            if elsewhere
            else "wait for it to end, or stop it (Ctrl-C or kill; the sweep stays resumable)"
        )
        raise SweepLocked(
            f"sweep {self.sweep_id} is being run by another driver: {who}; {fix}",
            file=str(self.path),
            field="SWEEP_ID",
        )

    def release(self) -> None:
        if self._handle is None:
            return
        with contextlib.suppress(OSError):
            self._handle.seek(0)
            self._handle.truncate()
            self._handle.write(json.dumps({"held": False, "sweep_id": self.sweep_id}))
            self._handle.flush()
        with contextlib.suppress(OSError):
            fcntl.flock(self._handle, fcntl.LOCK_UN)
        self._handle.close()
        self._handle = None

    def __getstate__(self) -> dict[str, Any]:
        # Tune may pickle what refers to the sweep: the open file is this process's.
        return {**self.__dict__, "_handle": None}
