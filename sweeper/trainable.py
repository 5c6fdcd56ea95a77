"""The Ray Tune trainable: one trainer child process per trial, its events forwarded to Tune."""

from __future__ import annotations

import contextlib
import ctypes
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ray import tune

from sweeper.search import OPTUNA_NUMBER_KEY
from sweeper.space import Space, static_check
from trainer.config import ConfigError
from trainer.events import EXIT_CODES, parse_line

LOG_TAIL_LINES = 60
_CODE_TO_CLASS = {code: name for name, code in EXIT_CODES.items()}


@dataclass(frozen=True)
class TrialRuntime:
    """How trials run: per-trial environment and limits, fixed for a sweep."""

    env: dict[str, str] = field(default_factory=dict)
    timeout_s: float = 900.0
    cache_dir: str | None = None
    python: str = sys.executable


def local_cpu_env(devices: int) -> dict[str, str]:
    """Environment of a trainer that runs on `devices` simulated CPU devices."""
    return {
        "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}",
        "JAX_PLATFORMS": "cpu",
        # libtpu looks for TPUs at import on hosts without them (TPU7X.md); quiet it.
        "TPU_ACCELERATOR_TYPE": "tpu7x-8",
        "TPU_WORKER_HOSTNAMES": "localhost",
    }


def _die_with_parent() -> None:
    # If the Ray worker dies (Tune stop, crash), the kernel kills the trainer too.
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _kill_group(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)


def failure_result(failure_class: str, message: str, **extra: Any) -> dict[str, Any]:
    return {
        "trial_status": "failed",
        "failure_class": failure_class,
        "failure_message": message[:2000],
        **extra,
    }


class TrialRun:
    """Runs one trainer process and turns its event stream into Tune results."""

    def __init__(self, space: Space, runtime: TrialRuntime, point: dict[str, Any], trial_dir: Path):
        self.space, self.runtime, self.point, self.trial_dir = space, runtime, point, trial_dir
        self.objectives = space.objective.metrics
        self.tail: deque[str] = deque(maxlen=LOG_TAIL_LINES)
        self.accepted: dict[str, Any] = {}
        self.compiled: dict[str, Any] = {}
        self.summary: dict[str, Any] | None = None
        self.failure: dict[str, Any] | None = None
        self.step_times: list[float] = []
        self.config = None  # the validated TrialConfig, set when the trial starts
        self.timed_out = False

    def base_fields(self) -> dict[str, Any]:
        return {"trial_status": "running", **{m: 0.0 for m in self.objectives}}

    def running_throughput(self) -> float:
        skip = self.config.measure.skip_steps
        timed = self.step_times[skip:] or self.step_times
        chips = self.accepted.get("chips") or 1
        return self.accepted.get("tokens_per_step", 0) / statistics.median(timed) / chips

    def on_event(self, event: dict[str, Any], report) -> None:
        kind = event["event"]
        if kind == "accepted":
            self.accepted = event
        elif kind == "compiled":
            self.compiled = event
        elif kind == "step":
            self.step_times.append(event["step_time_s"])
            metrics = {
                k: event[k] for k in ("step", "loss", "aux_loss", "grad_norm", "step_time_s")
            }
            running = self.running_throughput()
            report(
                {
                    **self.base_fields(),
                    **metrics,
                    "tokens_per_sec_per_chip_running": running,
                    "tokens_per_sec_per_chip": running,
                }
            )
        elif kind == "summary":
            self.summary = event
        elif kind == "failure":
            self.failure = event

    def final(self, returncode: int | None) -> dict[str, Any]:
        common = {
            "log_tail": "\n".join(self.tail),
            "effects": json.dumps(self.accepted.get("effects", {})),
            "hardware": self.accepted.get("hardware", ""),
            "backend": self.accepted.get("backend", ""),
            "fidelity": (self.summary or {}).get("fidelity") or self.space.effective_fidelity,
            "bound": (self.summary or {}).get("bound", ""),
            "compile_s": self.compiled.get("compile_s"),
        }
        summary = self.summary or {}
        numbers = {
            k: v
            for k, v in summary.items()
            if isinstance(v, int | float) and not isinstance(v, bool)
        }
        conv = summary.get("convergence") or {}
        if conv:
            numbers.update(
                convergence_passed=conv["passed"],
                convergence_delta=conv["delta"],
                convergence_relative_delta=conv["relative_delta"],
                convergence_tolerance=conv["tolerance"],
                convergence_reference=conv.get("reference_source", ""),
            )
        if self.timed_out:
            return {
                **common,
                **numbers,
                **failure_result(
                    "timeout", f"trial exceeded {self.runtime.timeout_s}s; process group killed"
                ),
            }
        if self.failure is not None:
            extra = {
                k: self.failure[k]
                for k in ("field", "step", "needed_gib", "budget_gib")
                if k in self.failure
            }
            return {
                **common,
                **numbers,
                **failure_result(
                    self.failure["failure_class"], self.failure.get("message", ""), **extra
                ),
            }
        if returncode != 0 or not summary:
            cls = _CODE_TO_CLASS.get(returncode, "crashed")
            return {
                **common,
                **numbers,
                **failure_result(
                    cls, f"trainer exited with code {returncode} and no failure event"
                ),
            }
        return {**common, **numbers, "trial_status": "ok", "failure_class": ""}

    def extra_args(self) -> list[str]:
        return ["--estimate-only"] if self.space.effective_fidelity == "estimate" else []

    def run(self, report) -> dict[str, Any]:
        try:
            config = self.config = static_check(self.space, self.point)
        except ConfigError as exc:
            return failure_result("invalid_config", exc.message, field=exc.field)
        config_path = self.trial_dir / "trial.json"
        config_path.write_text(config.to_json())
        env = {**os.environ, **self.runtime.env}
        spawned = time.time()
        with (self.trial_dir / "trainer.log").open("w") as log:
            proc = subprocess.Popen(
                [
                    self.runtime.python,
                    "-m",
                    "trainer",
                    "--config",
                    str(config_path),
                    *self.extra_args(),
                ],
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                env=env,
                start_new_session=True,  # its own process group, killed whole on stop
                preexec_fn=_die_with_parent,
            )
            timer = threading.Timer(self.runtime.timeout_s, self._on_timeout, args=(proc,))
            timer.start()
            try:
                for line in proc.stdout:
                    log.write(line)
                    self.tail.append(line.rstrip()[:500])
                    event = parse_line(line)
                    if event is not None:
                        self.on_event(event, report)
                returncode = proc.wait()
            finally:
                timer.cancel()
                _kill_group(proc)
        return {**self.final(returncode), "trainer_wall_s": time.time() - spawned}

    def _on_timeout(self, proc: subprocess.Popen) -> None:
        self.timed_out = True
        _kill_group(proc)


def run_trial(config: dict[str, Any], *, space: Space, runtime: TrialRuntime) -> None:
    """Ray Tune function trainable: `config` is the sampled point (knob path -> value)."""
    point = {k: v for k, v in config.items() if k != OPTUNA_NUMBER_KEY}
    trial_dir = Path(tune.get_context().get_trial_dir())
    trial_dir.mkdir(parents=True, exist_ok=True)
    started = time.time()
    trial = TrialRun(space, runtime, point, trial_dir)
    result = trial.run(lambda metrics: tune.report(metrics))
    # Tune needs the objective keys in every result; a failed trial has no value (NaN).
    objectives = {
        m: result.get(m, math.nan) if result["trial_status"] == "ok" else math.nan
        for m in space.objective.metrics
    }
    tune.report({**result, **objectives, "trial_wall_s": time.time() - started, "done": True})
