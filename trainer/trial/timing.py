"""Step-time statistics of a measured run, and the noise of its median: shared by our
trainer's timed loop and by the MaxText driver, which reads MaxText's step times from its log.
No JAX."""

from __future__ import annotations

import numpy as np

# Resamples of the bootstrap interval of the median step (fixed seed: the same steps give
# the same interval).
BOOTSTRAP_RESAMPLES = 2000
# Fewer timed steps give no interval (its figures are left out): resampling one or two steps says nothing of the
# noise (one step's "interval" is that step, which would call any lead beyond the noise).
MIN_STEPS_FOR_INTERVAL = 3


def step_time_stats(step_times_s: list[float], windows: int = 3) -> dict[str, float]:
    """Step-time statistics, and the noise of the median: a 95% bootstrap interval of the
    median step (resampling the timed steps), and the spread of the median step across
    `windows` consecutive windows of the timed steps ((slowest - fastest) / overall): drift
    within a trial, which a single interval hides."""
    times = np.asarray(step_times_s)
    median = float(np.median(times))
    resampled = np.random.default_rng(0).choice(times, size=(BOOTSTRAP_RESAMPLES, len(times)))
    low, high = np.percentile(np.median(resampled, axis=1), [2.5, 97.5])

    parts = [w for w in np.array_split(times, min(windows, len(times))) if len(w)]
    per_window = [float(np.median(w)) for w in parts]
    interval = (
        {"step_time_median_low_s": float(low), "step_time_median_high_s": float(high)}
        if len(times) >= MIN_STEPS_FOR_INTERVAL
        else {}  # too few steps: no interval at all (a figure is a number or absent)
    )
    return {
        "step_time_median_s": median,
        "step_time_p90_s": float(np.percentile(times, 90)),
        "step_time_min_s": float(np.min(times)),
        "step_time_max_s": float(np.max(times)),
        "timed_steps": len(times),
        **interval,
        "timing_windows": len(parts),
        "window_spread": (max(per_window) - min(per_window)) / median if median else 0.0,
    }


def throughput_interval(stats: dict[str, float], tokens_per_sec: float) -> dict[str, float]:
    """The median step's 95% interval as throughput (`tokens_per_sec` at the median step; a
    slower step is fewer tokens/s): tokens_per_sec_per_chip_low/_high, or nothing where the
    steps gave no interval."""
    if "step_time_median_low_s" not in stats:
        return {}
    median = stats["step_time_median_s"]
    return {
        "tokens_per_sec_per_chip_low": tokens_per_sec * median / stats["step_time_median_high_s"],
        "tokens_per_sec_per_chip_high": tokens_per_sec * median / stats["step_time_median_low_s"],
    }
