"""sweeper: performance sweeps for JAX training on TPU7x.

Public API (imported lazily so `sweeper validate` stays fast):
`run_sweep`, `Sweep` (the lifecycle: prepare -> tuner -> finish), `load_space`, `Space`,
`SweepResult`, `run_trial` (the Tune trainable), `SweepSearch` (Ray Tune's Searcher on
Optuna ask/tell), `DefineByRun` (the search space), `MemoryStore`/`MlflowStore` (where
records are kept; `tracking_uri="memory:NAME"` selects the first).
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "run_sweep": "sweeper.sweep",
    "Sweep": "sweeper.sweep",
    "SweepResult": "sweeper.sweep",
    "MemoryStore": "sweeper.stores",
    "MlflowStore": "sweeper.stores",
    "load_space": "sweeper.space",
    "Space": "sweeper.space",
    "SpaceError": "sweeper.space",
    "run_trial": "sweeper.trainable",
    "SweepSearch": "sweeper.search",
    "DefineByRun": "sweeper.search",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'sweeper' has no attribute {name!r}")
