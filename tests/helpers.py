"""Small builders shared by tests."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


def trial(model: str = "tiny-dense", **overrides: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "model": {"preset": model},
        "seq_len": 64,
        "per_device_batch": 1,
        "steps": 3,
        "backend": "cpu",
        "convergence": {"enabled": False},
    }
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            base[key] = {**base[key], **value}
        else:
            base[key] = value
    return base


def run_trainer(
    config: dict[str, Any], tmp_path: Path, devices: int = 8, timeout: float = 300, args=()
):
    """Run `python -m trainer` as the engine does; return (exit code, events, stderr)."""
    path = tmp_path / "trial.json"
    path.write_text(json.dumps(config))
    env = {
        **os.environ,
        "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}",
        "JAX_PLATFORMS": "cpu",
    }
    proc = subprocess.run(
        [sys.executable, "-m", "trainer", "--config", str(path), *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=timeout,
    )
    events = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    return proc.returncode, events, proc.stderr
