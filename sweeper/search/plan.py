"""`sweeper plan`'s two products beside its advice: a space that starts from it, and a compile
that holds it against the compiler."""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from trainer.estimate.plan import Candidate, Recommendation
from trainer.trial.events import parse_line
from trainer.trial.files import trainer_command

# How many of the next-fastest candidates lend their values to the written space's knobs.
NEIGHBOURS = 12


def space_for(
    rec: Recommendation, model: dict[str, Any], seq_len: int, target: str, name: str
) -> dict[str, Any]:
    """A compile-fidelity space whose trial 0 is the advice, sweeping the values of the
    candidates nearest it (each fits by the estimate) and the precision."""
    near = [rec.best, *rec.alternatives][: NEIGHBOURS + 1]
    knobs: dict[str, Any] = {}
    for axis in ("tensor", "expert", "context"):
        values = sorted({c.mesh[axis] for c in near})
        if len(values) > 1:
            knobs[f"mesh.{axis}"] = {"values": values}
    batches = sorted({c.per_device_batch for c in near})
    if len(batches) > 1:
        knobs["per_device_batch"] = {"values": batches}
    policies = list(dict.fromkeys(c.remat["policy"] for c in near))
    if len(policies) > 1:
        knobs["remat.policy"] = {"values": policies}
    if "custom" in policies:
        knobs["remat.custom.decoder_layer_input"] = {
            "values": ["offload", "device"],
            **({"when": {"remat.policy": "custom"}} if len(policies) > 1 else {}),
        }
    knobs["precision.mode"] = {"values": ["bf16", "fp8"]}
    warm = _knob_values(rec.best, knobs)
    trial: dict[str, Any] = {
        "seq_len": seq_len,
        "per_device_batch": rec.best.per_device_batch,
        "mesh": rec.mesh,
        "remat": rec.best.remat,
    }
    return {
        "name": name,
        "description": f"{model.get('preset', 'model')} at {seq_len:,} on {target} (compile "
        f"fidelity), starting from `sweeper plan`'s advice: {rec.best.describe()}.",
        "target": target,
        "fidelity": "compile",
        "model": model,
        "trial": trial,
        "search": {"sampler": "tpe", "trials": 12, "concurrency": 1, "warm_start": [warm]},
        "knobs": knobs,
    }


def _knob_values(best: Candidate, knobs: dict[str, Any]) -> dict[str, Any]:
    values: dict[str, Any] = {"precision.mode": "bf16"}
    for axis in ("tensor", "expert", "context"):
        if f"mesh.{axis}" in knobs:
            values[f"mesh.{axis}"] = best.mesh[axis]
    if "per_device_batch" in knobs:
        values["per_device_batch"] = best.per_device_batch
    if "remat.policy" in knobs:
        values["remat.policy"] = best.remat["policy"]
    if best.remat["policy"] == "custom" and "remat.custom.decoder_layer_input" in knobs:
        values["remat.custom.decoder_layer_input"] = best.remat["custom"]["decoder_layer_input"]
    return values


def compile_trial(
    config: dict[str, Any], target: str, timeout_s: float | None = None
) -> tuple[dict[str, dict[str, Any]], str] | None:
    """Compile one trial config for `target` with libtpu, in a child process as a compile
    trial does: its events by kind and its stderr; None when it ran past `timeout_s`."""
    trial = {**config, "compile_target": target, "convergence": {"enabled": False}}
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    with tempfile.TemporaryDirectory(prefix="sweeper-compile-") as tmp:
        path = Path(tmp) / "trial.json"
        path.write_text(json.dumps(trial))
        try:
            proc = subprocess.run(
                trainer_command(path),
                capture_output=True,
                text=True,
                env=env,
                timeout=timeout_s,
            )
        except subprocess.TimeoutExpired:
            return None
    events = {e["event"]: e for e in map(parse_line, proc.stdout.splitlines()) if e}
    if proc.returncode and "failure" not in events:
        events.pop("summary", None)  # a crash: no summary stands for the compile
    return events, proc.stderr


def compile_advice(
    rec: Recommendation, model: dict[str, Any], seq_len: int, target: str, timeout_s: float
) -> dict[str, Any]:
    """Compile the advice for the target; the compiler's memory, fits and failure beside
    the estimate's."""
    config = {"model": model, "seq_len": seq_len, **rec.best.trial()}
    done = compile_trial(config, target, timeout_s)
    if done is None:
        return {"status": "timeout", "message": f"no compile within {timeout_s:.0f} s"}
    events, stderr = done
    if "failure" in events:
        failure = events["failure"]
        return {
            "status": failure.get("failure_class", "failed"),
            "message": failure.get("message", ""),
        }
    summary = events.get("summary")
    if summary is None:
        return {"status": "crashed", "message": stderr.strip()[-500:]}
    return {
        "status": "ok",
        "hbm_per_device_gib": summary.get("hbm_per_device_gib"),
        "fits": summary.get("fits"),
        "est_tokens_per_sec_per_chip": summary.get("est_tokens_per_sec_per_chip"),
        "compile_s": summary.get("compile_s"),
    }
