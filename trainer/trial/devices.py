"""This host's JAX devices as a trial's process sees them, read by a short child process: the
reader never holds the accelerator (one process at a time can hold a TPU), so the program
that trains next can."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

from trainer.trial.hardware import ACCELERATORS, Accelerator

PROBE_TIMEOUT_S = 180.0
_PROBE = (
    "import json, jax\n"
    "d = jax.devices()\n"
    "print(json.dumps({'platform': d[0].platform, 'device_kind': d[0].device_kind, "
    "'count': len(d)}))\n"
)


class DevicesUnreadable(RuntimeError):
    """JAX could not start to read the devices (`why`: its last words, or the timeout)."""


def devices_seen(python: str = sys.executable, timeout: float = PROBE_TIMEOUT_S) -> dict[str, Any]:
    """{platform, device_kind, count} of this host's devices, as `python` finds them."""
    try:
        done = subprocess.run([python, "-c", _PROBE], capture_output=True, text=True,
                              timeout=timeout, env=os.environ.copy())  # fmt: skip
    except subprocess.TimeoutExpired:
        raise DevicesUnreadable(
            f"reading this host's devices with JAX took over {timeout:.0f} s"
        ) from None
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode or not lines:
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        raise DevicesUnreadable(f"JAX could not start on this host to read its devices "
                                f"({' / '.join(tail)[:400]})")  # fmt: skip
    seen: dict[str, Any] = json.loads(lines[-1])
    return seen


def accelerator_of(device_kind: str) -> Accelerator | None:
    """The datasheet of a JAX device kind (`TPU v5 lite` -> v5e); None for one we do not know."""
    return next((a for a in ACCELERATORS.values()
                 if a.device_kind and device_kind.startswith(a.device_kind)), None)  # fmt: skip
