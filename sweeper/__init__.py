"""sweeper: performance sweeps for JAX training on TPU7x.

Public API (imported lazily so `sweeper validate` stays fast):
`run_sweep`, `Sweep` (the lifecycle: prepare -> tuner -> finish), `load_space`, `Space`,
`SweepResult`, `TrialRow` (one trial of its table), `run_trial` (the Tune trainable),
`SweepSearch` (Ray Tune's Searcher on Optuna ask/tell), `DefineByRun` (the search space),
`MemoryStore`/`MlflowStore`/`store_for` (where records are kept; `tracking_uri="memory:NAME"`
selects the first).

The engine's folders are its systems; each imports only itself and the folders `LAYERS`
names for it (tests/test_layering.py holds the code to that, and to having no import cycle):

- space/    what a sweep searches: the YAML schema, loading and its checks, points, values
            pinned per backend.
- record/   what a sweep keeps: the typed results row, the tracking store (MLflow or memory),
            the tracker and its journal, the sweep's manifest, the MLflow layout.
- search/   how points are chosen: the Optuna searcher and its outcomes, the screen (the
            analytic estimate of every point), the ladder, the planner's space.
- execute/  where and how trials run: the Ray cluster, placement, the trial programs, the
            trainer processes (local or one per slice host), the Tune trainable, Tune's state.
- answer/   what a person reads: the results table and its best trial, notes, the report,
            the terminal, the export, live progress, the MLflow UI.
- sweep/    a sweep start to end (prepare -> tuner -> finish, resume), on all of the above.
- cli/      `sweeper ...`, on top.
"""

from __future__ import annotations

import importlib
from typing import Any

# folder -> the folders it may import besides itself.
LAYERS: dict[str, frozenset[str]] = {
    "space": frozenset(),
    "record": frozenset({"space"}),
    "search": frozenset({"space", "record"}),
    "execute": frozenset({"space", "record"}),
    "answer": frozenset({"space", "record", "search"}),
    "sweep": frozenset({"space", "record", "search", "execute", "answer"}),
    "cli": frozenset({"space", "record", "search", "execute", "answer", "sweep"}),
}

_EXPORTS = {
    "run_sweep": "sweeper.sweep",
    "Sweep": "sweeper.sweep",
    "SweepResult": "sweeper.sweep",
    "TrialRow": "sweeper.record.row",
    "MemoryStore": "sweeper.record.stores",
    "MlflowStore": "sweeper.record.stores",
    "store_for": "sweeper.record.stores",
    "load_space": "sweeper.space.load",
    "Space": "sweeper.space.schema",
    "SpaceError": "sweeper.space.errors",
    "run_trial": "sweeper.execute.trainable",
    "SweepSearch": "sweeper.search.searcher",
    "DefineByRun": "sweeper.search.distributions",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'sweeper' has no attribute {name!r}")
