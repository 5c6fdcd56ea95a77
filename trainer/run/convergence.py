"""Convergence check: this run's losses against the baseline-numerics reference curve."""

from __future__ import annotations

import hashlib
import json
import math
import platform as platform_module
from pathlib import Path
from typing import Any

import jax
from filelock import FileLock

from trainer.trial.config import TrialConfig
from trainer.trial.files import cache_dir, write_json

# The tolerance a recipe's reference derives from its noise: a trial may end this many
# times as far from the reference as a run with another initialization does, and never
# closer than the floor (float reordering alone moves a final loss by ~0.05% here).
NOISE_MULTIPLE = 3.0
TOLERANCE_FLOOR = 0.005


def reference_key(config: TrialConfig, platform: str, global_batch: int) -> str:
    """Hash of everything that fixes the baseline loss curve: the recipe (with the recipe's
    hyperparameters where the trial changes them), its global batch, the platform it runs on,
    and the corpus' Python."""
    inputs = {
        "recipe": config.baseline().numerics_signature(),
        "global_batch": global_batch,
        "platform": platform,
        "python": platform_module.python_version(),
        "jax": jax.__version__,
    }
    return hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()[:20]


def _path(config: TrialConfig, platform: str, global_batch: int) -> Path:
    key = reference_key(config, platform, global_batch)
    return cache_dir(config) / "reference" / f"{key}.json"


def lock(config: TrialConfig, platform: str, global_batch: int) -> FileLock:
    """Held while a reference is looked up and, if missing, computed: concurrent trials of
    one recipe wait for the first one's reference instead of each computing their own."""
    path = _path(config, platform, global_batch).with_suffix(".lock")
    path.parent.mkdir(parents=True, exist_ok=True)
    return FileLock(path)


# What a reference holds (`reference_from_runs`).
REFERENCE_FIELDS = ("losses", "other_init_losses", "init_seeds", "mesh", "seed_noise", "tolerance")


def load_reference(config: TrialConfig, platform: str, global_batch: int) -> dict | None:
    """The recipe's cached reference; None when there is none, or none whole (damaged, or
    holding less than a reference does now): then it is computed again."""
    path = _path(config, platform, global_batch)
    try:
        reference = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    whole = isinstance(reference, dict) and all(k in reference for k in REFERENCE_FIELDS)
    return reference if whole else None


def store_reference(config: TrialConfig, platform: str, global_batch: int, reference: dict) -> Path:
    recipe = config.baseline().numerics_signature()
    return write_json(_path(config, platform, global_batch), {"recipe": recipe, **reference})


def final_loss(losses: list[float], window: int) -> float:
    window = min(window, len(losses))
    return sum(losses[-window:]) / window


def reference_from_runs(
    losses: list[float], other_init: list[float], window: int, mesh: dict, init_seeds: list[int]
) -> dict[str, Any]:
    """The reference of a recipe from its two baseline runs (same data, two initializations):
    the first run's curve, and the tolerance derived from how far the two end apart."""
    final, other = final_loss(losses, window), final_loss(other_init, window)
    noise = abs(other - final) / final if final else float("inf")
    return {
        "losses": losses,
        "other_init_losses": other_init,
        "init_seeds": init_seeds,
        "mesh": mesh,
        "seed_noise": noise,
        "tolerance": max(NOISE_MULTIPLE * noise, TOLERANCE_FLOOR),
    }


def verdict(
    losses: list[float], reference: dict[str, Any], configured: float | None, window: int
) -> dict[str, Any]:
    """Pass if every loss is finite and the final loss is within the tolerance (relative) of
    the reference's: the configured one, or else the one the reference derived from its noise."""
    derived = configured is None
    tolerance: float = reference["tolerance"] if configured is None else configured
    window = min(window, len(losses), len(reference["losses"]))
    final = final_loss(losses, window)
    ref_final = final_loss(reference["losses"], window)
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
        "tolerance_source": (
            f"{NOISE_MULTIPLE:g} x seed noise {reference['seed_noise']:.2%} (floor {TOLERANCE_FLOOR:.1%})"
            if derived
            else "configured"
        ),
        "seed_noise": reference["seed_noise"],
        "reference_mesh": reference["mesh"],
        "window": window,
        "reason": reason,
    }
