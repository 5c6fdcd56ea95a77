"""`sweeper ui`: the MLflow UI for a sweep's store, on 127.0.0.1 only, opened on the sweep's
runs; a tracking server is already serving, so its URL is printed and nothing is started."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from importlib.metadata import entry_points
from pathlib import Path
from typing import IO

from sweeper.record.manifest import SweepManifest
from sweeper.record.mlflow_view import runs_url
from sweeper.record.stores import MEMORY_SCHEME, MlflowStore
from sweeper.space.errors import SpaceError

HOST = "127.0.0.1"
APP = "sweeper"  # the MLflow app plugin pyproject.toml registers (answer/mlflow_app)
START_TIMEOUT_S = 120.0


def serve(manifest: SweepManifest, port: int, say: Callable[[str], None]) -> None:
    """Serve the sweep's store until interrupted (Ctrl-C), once its page answers."""
    uri = manifest.tracking_uri
    if uri.startswith(MEMORY_SCHEME):
        raise SpaceError(
            f"sweep {manifest.sweep_id} kept its records in its process's memory ({uri}); "
            "they are gone. Run sweeps with an MLflow store to browse them",
            field="SWEEP_ID",
        )
    if uri.startswith(("http://", "https://")):
        say(runs_url(uri, manifest.experiment_id, manifest.sweep_id))
        return
    # A folder brought back from the host that ran it: MLflow's artifact paths follow it.
    MlflowStore(uri).experiment(manifest.space.name, Path(manifest.storage) / "mlartifacts")
    # One worker and no job runner: a page for one person, up in seconds (`mlflow ui`'s
    # defaults started 4 uvicorn workers and a huey job runner, 12 processes, 3.4 GB).
    command = [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", uri,
               "--host", HOST, "--port", str(port), "--workers", "1"]  # fmt: skip
    if APP in {e.name for e in entry_points(group="mlflow.app")}:
        command += ["--app-name", APP]  # its page opens in Model training (answer/mlflow_app)
    else:
        say(f"note: the `{APP}` MLflow app is not installed (pip install -e . registers it); a "
            "page without the URL's workflowType opens MLflow in GenAI until you choose Model "
            "training in its sidebar")  # fmt: skip
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    base = f"http://{HOST}:{port}"
    # A SIGTERM (a supervisor, `kill`) stops the UI as Ctrl-C does, never orphaning it.
    signal.signal(signal.SIGTERM, _interrupt)
    # The UI's own log, read only if it fails to start.
    with tempfile.TemporaryFile() as log:
        server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            wait_for(base, server, log)
            say(f"MLflow UI for {uri} (Ctrl-C stops it):")
            say(runs_url(base, manifest.experiment_id, manifest.sweep_id))
            charts = runs_url(base, manifest.experiment_id, manifest.sweep_id, charts=True)
            say(f"charts: {charts}")
            server.wait()
        except KeyboardInterrupt:
            pass
        finally:
            server.terminate()
            server.wait(timeout=30)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def wait_for(base: str, server: subprocess.Popen[bytes], log: IO[bytes]) -> None:
    """Until the UI answers at `base`; ConnectionError (with its log) when it exits first."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if server.poll() is not None:
            log.seek(0)
            said = log.read().decode(errors="replace")[-1500:]
            raise ConnectionError(f"the MLflow UI exited ({server.returncode}): {said}")
        try:
            with urllib.request.urlopen(f"{base}/health", timeout=2) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            time.sleep(0.5)
    raise ConnectionError(f"the MLflow UI did not answer at {base} within {START_TIMEOUT_S:.0f} s")
