"""What a step costs and how fast it ran: analytic FLOPs, peak tables, step-time statistics."""

from __future__ import annotations

import json
import os
import platform
import time
from dataclasses import dataclass
from pathlib import Path

from trainer.trial.files import write_json
from trainer.trial.hardware import ACCELERATORS


@dataclass(frozen=True)
class Chip:
    """Peak dense TFLOP/s per chip by precision, and how many JAX devices a chip shows."""

    name: str
    peak_tflops: dict[str, float]
    devices_per_chip: int
    source: str


# Vendor peaks (docs/trainer.md, Measurement), from the datasheet table the estimate uses too.
# Keys are jax Device.device_kind prefixes.
CHIPS: dict[str, Chip] = {
    a.device_kind: Chip(a.name, dict(a.peak_tflops), a.devices_per_chip, "datasheet")
    for a in ACCELERATORS.values()
}


def peak_for(chip: Chip, precision: str) -> float | None:
    """Peak TFLOP/s of the precision the step ran in (docs/trainer.md, Measurement: MFU uses that peak); None if unknown."""
    return chip.peak_tflops.get(precision)


def chip_for(
    device_kind: str, platform_name: str, num_devices: int, cache_dir: Path | None
) -> Chip:
    for prefix, chip in CHIPS.items():
        if device_kind.startswith(prefix):
            return chip
    if platform_name == "cpu":
        # Simulated CPU devices share one host: the host is the "chip".
        peak = measured_cpu_peak_tflops(cache_dir)
        cores = _usable_cores()
        return Chip(
            f"cpu ({platform.machine()}, {cores} core{'s' if cores != 1 else ''})",
            {"bf16": peak, "fp8": peak},
            num_devices,
            "measured",
        )
    return Chip(device_kind, {}, 1, "unknown")


def _usable_cores() -> int:
    """Cores this process may run on: a trial pinned to 1 of 16 cores has a 1-core peak."""
    return len(os.sched_getaffinity(0))


def measured_cpu_peak_tflops(cache_dir: Path | None) -> float:
    """Best f32 matmul TFLOP/s of this host, measured once and cached by host and JAX version."""
    import jax
    import jax.numpy as jnp

    key = f"{platform.node()}-{platform.machine()}-{_usable_cores()}-jax{jax.__version__}"
    path = (cache_dir / "cpu_peak.json") if cache_dir else None
    if path and path.exists():
        cached = json.loads(path.read_text())
        if key in cached:
            return float(cached[key])
    n = 1024
    cpu = jax.devices("cpu")[0]
    a = jax.device_put(jnp.ones((n, n), jnp.float32), cpu)
    matmul = jax.jit(lambda x: x @ x)
    matmul(a).block_until_ready()
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        matmul(a).block_until_ready()
        best = min(best, time.perf_counter() - start)
    tflops = 2 * n**3 / best / 1e12
    if path:
        cached = json.loads(path.read_text()) if path.exists() else {}
        write_json(path, {**cached, key: tflops})
    return tflops


def cpu_jiffies(cores: set[int]) -> tuple[float, float] | None:
    """(busy, total) clock ticks of these cores since boot (Linux /proc/stat); None elsewhere."""
    try:
        lines = Path("/proc/stat").read_text().splitlines()
    except OSError:
        return None
    busy = total = 0.0
    for line in lines:
        name, *fields = line.split()
        if not name.startswith("cpu") or name == "cpu" or int(name[3:]) not in cores:
            continue
        values = [float(v) for v in fields]
        idle = values[3] + (values[4] if len(values) > 4 else 0.0)  # idle + iowait
        busy, total = busy + sum(values) - idle, total + sum(values)
    return busy, total


class Contention:
    """How much of this process's cores other processes used while it ran: the cores' busy
    ticks less this process's own CPU time, over the cores' total ticks. A CPU trial pinned
    to cores another program also uses measures that program too."""

    def __init__(self) -> None:
        self.cores = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set()
        self.start = cpu_jiffies(self.cores)
        self.own = _own_cpu_s()

    def share(self) -> float | None:
        end = cpu_jiffies(self.cores)
        if self.start is None or end is None or not self.cores:
            return None
        tick = os.sysconf("SC_CLK_TCK")
        busy, total = (end[0] - self.start[0]) / tick, (end[1] - self.start[1]) / tick
        others = busy - (_own_cpu_s() - self.own)
        return max(0.0, others / total) if total > 0 else None


def _own_cpu_s() -> float:
    usage = os.times()
    return usage.user + usage.system
