"""The ladder's first rung: every point of a space (or a sample of it) judged by the analytic
estimate in this process (no Ray trial, no child process, milliseconds a point): whether
the trial configuration is valid, whether it fits the target's memory by the estimate,
and its estimated tokens/s. Fidelity estimate: a ranking to spend compiles on, never a
measurement (the estimate's held-out memory error is in benchmarks.memory_model).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import pandas as pd

from sweeper.record.row import knob_column, knob_columns
from sweeper.space.checks import static_check
from sweeper.space.points import count_points, maxtext_knobs, points, sample_points
from sweeper.space.schema import Space
from trainer.estimate.analytic import F32, estimate
from trainer.trial.config import ConfigError
from trainer.trial.hardware import GIB, Topology
from trainer.trial.maxtext import grad_bytes

# Verdicts of a screened point, and how a count of them reads.
FITS, OVER_HBM, INVALID = "fits", "over_hbm", "invalid"
VERDICT_WORDS = {FITS: "fit", OVER_HBM: "over HBM", INVALID: "invalid"}
# Points enumerated before sampling, at most.
ENUMERATE_AT_MOST = 1_000_000


PROGRESS_EVERY = 1000  # points judged between progress reports


def verdict_counts(frame: pd.DataFrame) -> str:
    """How many screened points each verdict has, in words: `464 fit, 112 over HBM`."""
    counts = frame["verdict"].value_counts() if "verdict" in frame else pd.Series(dtype=int)
    return ", ".join(f"{n:,} {VERDICT_WORDS.get(str(v), str(v))}" for v, n in counts.items())


def screen(
    space: Space,
    sample: int | None = None,
    seed: int = 0,
    progress: Callable[[int, int], None] | None = None,
) -> pd.DataFrame:
    """One row a point: its knobs, verdict, estimated memory per device, est. tokens/s per
    chip and rank among the points that fit (1 is the best; by the space's objective when
    it is an estimate, else by est. tokens/s). `sample`: that many points drawn at random.
    `progress(judged, of)` hears every PROGRESS_EVERY points (an imported recipe's space
    holds a million: about 1.5 ms each)."""
    if not space.is_tpu_target:
        raise ValueError("screening estimates for a TPU target: give a space with target tpu7x:...")
    topology = space.target.tpu
    size = count_points(space) if sample is not None else 0  # None: a continuous range
    if sample is not None and (size is None or size > ENUMERATE_AT_MOST):
        chosen = sample_points(space, sample, seed)  # drawn from all of it, not its first million
    else:
        chosen = points(space, ENUMERATE_AT_MOST)
        if sample is not None and sample < len(chosen):
            chosen = random.Random(seed).sample(chosen, sample)
    limit = memory_limit_gib(space)
    rows = []
    for i, point in enumerate(chosen):
        if progress is not None and i % PROGRESS_EVERY == 0:
            progress(i, len(chosen))
        rows.append(_judge(space, point, topology, limit))
    if progress is not None:
        progress(len(chosen), len(chosen))
    frame = pd.DataFrame(rows)
    if "est_tokens_per_sec_per_chip" not in frame:  # no point valid: nothing to rank
        return frame.assign(rank=float("nan"))
    metric = space.objective.primary.metric
    metric = (
        metric if metric.startswith("est_") and metric in frame else "est_tokens_per_sec_per_chip"
    )
    fits = frame["verdict"] == FITS
    ascending = space.objective.primary.mode == "min" and metric == space.objective.primary.metric
    frame.loc[fits, "rank"] = frame.loc[fits, metric].rank(ascending=ascending, method="min")
    return frame.sort_values(["rank", "verdict"], na_position="last").reset_index(drop=True)


def memory_limit_gib(space: Space) -> float:
    """What one device of the target offers a program, or the space's tighter budget
    (constraints.max_memory_per_device_gib)."""
    limit = space.target.tpu.accelerator.usable_hbm_per_device / GIB
    budget = space.constraints.max_memory_per_device_gib
    return min(limit, budget) if budget else limit


def expected_gib(memory: dict[str, float], device_gib: float) -> float:
    """What a device is expected to allocate, by the estimate: what the step takes with room;
    or, where that is more than the device offers and the step's floor is not, all it offers
    (libtpu packs the step into the device: gpt-oss-120b's recipe 92.88 GiB of 94.75). Into
    the device, not a space's tighter budget: that is checked against what the compile took."""
    total, floor = memory["total"] / GIB, memory["floor"] / GIB
    return device_gib if floor <= device_gib < total else total


def judge(space: Space, point: dict[str, Any]) -> dict[str, Any]:
    """One point of a TPU space judged as the screen judges each (its row)."""
    return _judge(space, point, space.target.tpu, memory_limit_gib(space))


def _judge(
    space: Space, point: dict[str, Any], topology: Topology, limit_gib: float
) -> dict[str, Any]:
    row: dict[str, Any] = {knob_column(k): v for k, v in point.items()}
    # MaxText's own settings (`maxtext.*` knobs) are none of the estimate's: it judges the
    # point without them (`unseen_knobs` names them), as it judges our trainer's.
    ours = {k: v for k, v in point.items() if k not in maxtext_knobs(point)}
    try:
        config = static_check(space, ours, topology.devices)
        maxtext = space.program == "maxtext"
        grads = grad_bytes(space.maxtext_program(), point) if maxtext else F32
        est = estimate(config, topology.accelerator, topology.devices, maxtext=maxtext,
                       grad_bytes=grads)  # fmt: skip
    except ConfigError as exc:
        row.update(verdict=INVALID, why=f"{exc.field}: {exc.message}")
        return row
    memory = est["est_memory_per_device"]
    expected = expected_gib(memory, topology.accelerator.usable_hbm_per_device / GIB)
    fits = est["fits"] and expected <= limit_gib
    row.update(
        verdict=FITS if fits else OVER_HBM,
        why=""
        if fits
        else "over the target's HBM, the space's budget or host memory by the estimate",
        est_hbm_per_device_gib=expected,
        est_host_per_device_gib=memory["host_activations"] / GIB,
        est_tokens_per_sec_per_chip=est["est_tokens_per_sec_per_chip"],
        est_step_time_s=est["est_step_time_s"],
        est_mfu=est["est_mfu"],
        bound=est["bound"],
    )
    return row


def caveats(space: Space) -> list[str]:
    """What the screen's figures are of, where that is not the space's own program."""
    if space.program != "maxtext":
        return []
    said = [
        "program maxtext: the estimate is the engine's model of the same shape and settings, "
        "not MaxText's program (a compile measures that: the ladder's verify rung, or `sweeper "
        "run`)"
    ]
    recipe = space.maxtext_program().recipe
    if recipe is not None and recipe.unmodeled:
        said.append(
            "the estimate does not model: " + "; ".join(recipe.unmodeled) + " (its figures for "
            "this model are of the shape alone: rank by them with care, verify by compile)"
        )
    return said


def unseen_knobs(frame: pd.DataFrame) -> list[str]:
    """Knobs whose value changes no estimated figure of any screened point (the other knobs
    held): the estimate cannot tell their values apart; only a compile can. A knob no two
    screened points compare (a sample: every other knob differs too) is not named: nothing
    shows it unseen."""
    knobs = list(knob_columns(frame.columns))
    judged = frame[frame["verdict"] != INVALID]
    if "est_tokens_per_sec_per_chip" not in judged:  # no valid point: nothing estimated
        return []
    unseen = []
    for knob in knobs:
        others = [k for k in knobs if k != knob]
        figures = judged[[*others, knob, "est_tokens_per_sec_per_chip", "est_hbm_per_device_gib"]]
        figures = figures.astype({k: str for k in [*others, knob]})
        groups = figures.groupby(others, dropna=False) if others else [(None, figures)]
        compared = [g for _, g in groups if g[knob].nunique() > 1]
        if compared and all(
            g["est_tokens_per_sec_per_chip"].round(6).nunique() <= 1
            and g["est_hbm_per_device_gib"].round(6).nunique() <= 1
            for g in compared
        ):
            unseen.append(knob_columns([knob])[knob])
    return unseen
