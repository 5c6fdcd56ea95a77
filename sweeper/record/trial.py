"""What the sweep reads of a trial while it runs and when it ends: the part of Ray Tune's
`Trial` its callbacks, table and progress use. Tune's trials are such trials; so are the host
runner's (sweeper/sweep/host.py), which runs a sweep's trials on one host without Ray."""

from __future__ import annotations

from typing import Any, Protocol

# Tune's trial states, as its `Trial.status` spells them.
PENDING, RUNNING, TERMINATED, ERROR = "PENDING", "RUNNING", "TERMINATED", "ERROR"


class TrialStorage(Protocol):
    @property
    def trial_working_directory(self) -> str: ...


class SweepTrial(Protocol):
    """A trial as the sweep's callbacks see it: its id, its point (`config`), its state, its
    last report, and where its files are (None where this host cannot read them)."""

    @property
    def trial_id(self) -> str: ...

    @property
    def config(self) -> dict[str, Any]: ...

    @property
    def status(self) -> str: ...

    @property
    def last_result(self) -> dict[str, Any]: ...

    @property
    def storage(self) -> TrialStorage | None: ...
