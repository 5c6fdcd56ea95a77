"""Convergence check: this run's losses against the baseline-numerics reference curve."""

from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import tempfile
from pathlib import Path
from typing import Any

import jax

from trainer.config import TrialConfig

DEFAULT_CACHE = Path(os.environ.get("SWEEPER_CACHE_DIR", Path.home() / ".cache" / "sweeper"))


def cache_dir(config: TrialConfig) -> Path:
    """The sweep's shared cache; a host that cannot write there keeps its own (the reference
    is then computed by the trial itself)."""
    path = Path(config.convergence.cache_dir) if config.convergence.cache_dir else DEFAULT_CACHE
    try:
        path.mkdir(parents=True, exist_ok=True)
        if os.access(path, os.W_OK):
            return path
    except OSError:
        pass
    return Path(tempfile.gettempdir()) / "sweeper-cache"


def reference_key(config: TrialConfig) -> str:
    """Hash of everything that fixes the baseline loss curve, including the corpus' Python."""
    inputs = {
        "recipe": config.numerics_signature(),
        "python": platform.python_version(),
        "jax": jax.__version__,
    }
    return hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()[:20]


def _path(config: TrialConfig) -> Path:
    return cache_dir(config) / "reference" / f"{reference_key(config)}.json"


def load_reference(config: TrialConfig) -> list[float] | None:
    path = _path(config)
    if not path.exists():
        return None
    return json.loads(path.read_text())["losses"]


def store_reference(config: TrialConfig, losses: list[float]) -> Path:
    path = _path(config)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"recipe": config.numerics_signature(), "losses": losses}))
    tmp.replace(path)  # atomic: concurrent trials may race to write the same reference
    return path


def verdict(
    losses: list[float], reference: list[float], tolerance: float, window: int
) -> dict[str, Any]:
    """Pass if every loss is finite and the final loss is within `tolerance` (relative) of the reference."""
    window = min(window, len(losses), len(reference))
    final = sum(losses[-window:]) / window
    ref_final = sum(reference[-window:]) / window
    finite = all(math.isfinite(x) for x in losses)
    delta = final - ref_final
    relative = delta / ref_final if ref_final else float("inf")
    passed = finite and math.isfinite(relative) and abs(relative) <= tolerance
    if not finite:
        reason = "non-finite loss"
    elif passed:
        reason = f"final loss within {tolerance:.1%} of the reference"
    else:
        reason = f"final loss {final:.4f} is {relative:+.1%} from the reference {ref_final:.4f} (tolerance {tolerance:.1%})"
    return {
        "passed": passed,
        "final_loss": final,
        "reference_final_loss": ref_final,
        "delta": delta,
        "relative_delta": relative,
        "tolerance": tolerance,
        "window": window,
        "reason": reason,
    }
