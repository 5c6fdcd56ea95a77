"""Small builders shared by tests."""

from __future__ import annotations

import gzip
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from trainer.trial.events import parse_event, parse_line

REPO = Path(__file__).resolve().parents[1]
DATA = Path(__file__).resolve().parent / "data"


def hlo_excerpt(name: str) -> str:
    """An HLO text kept in tests/data (gzipped when it ends in .gz), less its `#` header
    lines (where it came from)."""
    raw = (DATA / name).read_bytes()
    text = (gzip.decompress(raw) if name.endswith(".gz") else raw).decode()
    return "\n".join(line for line in text.splitlines() if not line.startswith("#"))


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
    # Every line that claims to be an event must be a valid one (parse_event raises if not).
    typed = [parse_event(line) for line in proc.stdout.splitlines() if parse_line(line)]
    events = [e.model_dump(mode="json", exclude_none=True) for e in typed]
    return proc.returncode, events, proc.stderr


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MlflowServer:
    """A real `mlflow server` (SQLite store, served artifacts) that can be stopped and restarted
    on the same port and store."""

    def __init__(self, root: Path):
        self.root, self.port = root, free_port()
        self.uri = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    def start(self) -> str:
        from mlflow.tracking import MlflowClient

        self.root.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "mlflow", "server",
             "--backend-store-uri", f"sqlite:///{self.root}/server.db",
             "--artifacts-destination", str(self.root / "artifacts"),
             "--host", "127.0.0.1", "--port", str(self.port), "--workers", "1"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,  # the server starts job consumers: stop them all with it
        )  # fmt: skip
        deadline = time.time() + 60
        while time.time() < deadline:
            try:
                MlflowClient(self.uri).search_experiments(max_results=1)
                return self.uri
            except Exception:
                time.sleep(0.5)
        self.stop(sig=signal.SIGKILL)
        raise RuntimeError("mlflow server did not start in 60 s")

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc is None:
            return
        os.killpg(self.proc.pid, sig)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:  # a loaded host: the server's workers stop slowly
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        self.proc = None


def unfolded(text: str) -> str:
    """What the CLI said, its lines (folded to the terminal's width) read as one: the words
    with single spaces between them."""
    return " ".join(text.split())
