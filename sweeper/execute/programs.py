"""What runs a trial: this project's trainer, or MaxText. A program turns a sampled point into
the trainer command's arguments for the space's fidelity, and says before any trial whether
it can run here; both speak the trainer's event protocol (trainer/trial/events.py), so a
trial's result is typed the same whichever ran it (MaxText's output is read back into those
events by trainer/maxtext/driver.py).
"""

from __future__ import annotations

import json
import os
from typing import Any, Protocol

from sweeper.space.errors import SpaceError
from sweeper.space.points import maxtext_knobs
from sweeper.space.schema import Space


class TrialProgram(Protocol):
    name: str

    def args(self, space: Space, point: dict[str, Any]) -> list[str]:
        """Arguments of `python -m trainer` beyond the trial's configuration."""
        ...

    def check(self, space: Space) -> None:
        """Raise SpaceError when the program cannot run this space's trials here."""
        ...


class SweeperTrainer:
    name = "sweeper-trainer"

    def args(self, space: Space, point: dict[str, Any]) -> list[str]:
        return ["--estimate-only"] if space.effective_fidelity == "estimate" else []

    def check(self, space: Space) -> None:
        return None


class MaxText:
    """MaxText 0.2.5 in its own Python: `train_compile` for compile fidelity, `train` for run."""

    name = "maxtext"

    def args(self, space: Space, point: dict[str, Any]) -> list[str]:
        request = {
            "program": space.maxtext_program().model_dump(mode="json"),
            "knobs": maxtext_knobs(point),
            "target": str(space.target),
        }
        return ["--maxtext", json.dumps(request)]

    def check(self, space: Space) -> None:
        python = space.maxtext_program().interpreter()
        if not os.access(python, os.X_OK):
            raise SpaceError(
                f"{python} is not an executable Python: build MaxText's environment with "
                "`make maxtext`, or name one that has maxtext==0.2.5 (maxtext.python, or "
                "$SWEEPER_MAXTEXT_PYTHON)",
                field="maxtext.python",
            )


PROGRAMS: dict[str, TrialProgram] = {p.name: p for p in (SweeperTrainer(), MaxText())}


def program_of(space: Space) -> TrialProgram:
    return PROGRAMS[space.program]
