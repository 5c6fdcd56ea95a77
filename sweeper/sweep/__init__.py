"""A sweep, start to end: its lifecycle (`Sweep`: prepare -> tuner -> finish, or resume),
`run_sweep` for the whole of it, and what it produced (`SweepResult`)."""

from sweeper.sweep.lifecycle import Sweep
from sweeper.sweep.result import (
    ResultsUnwritable,
    SweepFinished,
    SweepInterrupted,
    SweepResult,
    unfinished,
)
from sweeper.sweep.run import run_sweep

__all__ = [
    "ResultsUnwritable",
    "Sweep",
    "SweepFinished",
    "SweepInterrupted",
    "SweepResult",
    "run_sweep",
    "unfinished",
]
