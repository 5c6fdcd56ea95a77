"""`sweeper plan`'s two products beside its advice: a space that starts from it, and a compile
that holds it against the compiler."""

from __future__ import annotations

import json
import math
import os
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from trainer.estimate.plan import HEADROOM, Candidate, Recommendation
from trainer.trial.events import parse_line
from trainer.trial.files import trainer_command
from trainer.trial.hardware import Topology

# How many of the next-fastest candidates lend their values to the written space's knobs.
NEIGHBOURS = 12
AXES = ("tensor", "expert", "context")


def space_for(
    rec: Recommendation, model: dict[str, Any], seq_len: int, target: str, name: str
) -> dict[str, Any]:
    """A compile-fidelity space whose trial 0 is the advice (trial 1 the fastest fp8
    candidate), sweeping the values of the candidates nearest it and the precision.

    Every point of it is a candidate the plan estimated (each knob's values are candidates'
    values; one custom placement and one Splash block, the advice's; the plan's memory limit
    as the space's budget), so `screen` finds no point faster than the advice in its precision.
    """
    best = rec.best
    near = [c for c in [best, *rec.alternatives][: NEIGHBOURS + 1] if _expressible(c, best)]
    fp8 = rec.fp8 if rec.fp8 is not None and _expressible(rec.fp8, best) else None
    near += [fp8] if fp8 is not None else []
    knobs: dict[str, Any] = {}
    for axis in AXES:
        _vary(knobs, f"mesh.{axis}", [c.mesh[axis] for c in near], sort=True)
    _vary(knobs, "per_device_batch", [c.per_device_batch for c in near], sort=True)
    _vary(knobs, "vocab_tiling", [c.vocab_tiling for c in near], sort=True)
    _vary(knobs, "remat.policy", [c.remat["policy"] for c in near])
    placement = _placement(near)
    if "remat.policy" in knobs and placement:
        for tensor, where in placement.items():
            knobs[f"remat.custom.{tensor}"] = {
                "values": [where],
                "when": {"remat.policy": "custom"},
            }
    knobs["precision.mode"] = {"values": ["bf16", "fp8"]}
    trial: dict[str, Any] = {
        "seq_len": seq_len,
        **{k: v for k, v in best.trial().items() if k != "remat"},
        "remat": {"policy": best.remat["policy"]} if "remat.policy" in knobs else best.remat,
    }
    warm = [_knob_values(best, knobs, "bf16")]
    warm += [_knob_values(fp8, knobs, "fp8")] if fp8 is not None else []
    return {
        "name": name,
        "description": f"{model.get('preset', 'model')} at {seq_len:,} on {target} (compile "
        f"fidelity), starting from `sweeper plan`'s advice: {best.describe()}.",
        "target": target,
        "fidelity": "compile",
        "model": model,
        "trial": trial,
        "constraints": {"max_memory_per_device_gib": round(memory_limit_gib(target), 3)},
        "search": {"sampler": "tpe", "trials": 12, "concurrency": 1, "warm_start": warm},
        "knobs": knobs,
    }


def memory_limit_gib(target: str) -> float:
    """The plan's budget: a device's usable HBM less HEADROOM, rounded down to the MiB."""
    usable = Topology.parse(target).accelerator.usable_hbm_per_device
    return math.floor(usable * (1 - HEADROOM) / 2**20) / 1024


def _expressible(c: Candidate, best: Candidate) -> bool:
    """Whether the space written around `best` can hold `c`: one Splash block and at most one
    custom placement (the first near the advice) in a space, so that its points stay
    candidates."""
    custom = best.remat if best.remat["policy"] == "custom" else None
    return c.splash_block == best.splash_block and (
        c.remat["policy"] != "custom" or custom is None or c.remat == custom
    )


def _placement(near: list[Candidate]) -> dict[str, str]:
    customs = [c.remat["custom"] for c in near if c.remat["policy"] == "custom"]
    return dict(customs[0]) if customs else {}


def _vary(knobs: dict[str, Any], key: str, values: list[Any], sort: bool = False) -> None:
    distinct = list(dict.fromkeys(values))
    if len(distinct) > 1:
        knobs[key] = {"values": sorted(distinct) if sort else distinct}


def _knob_values(c: Candidate, knobs: dict[str, Any], precision: str) -> dict[str, Any]:
    """The candidate as a point of the space's knobs."""
    values: dict[str, Any] = {
        **{f"mesh.{axis}": c.mesh[axis] for axis in AXES},
        "per_device_batch": c.per_device_batch,
        "vocab_tiling": c.vocab_tiling,
        "remat.policy": c.remat["policy"],
        **{f"remat.custom.{k}": v for k, v in c.remat.get("custom", {}).items()},
        "precision.mode": precision,
    }
    return {k: v for k, v in values.items() if k in knobs}


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
