"""The analytic memory estimate (trainer/estimate/analytic.py: memory_per_device) against
libtpu's compiled memory per device, on TPU7x topologies compiled on this CPU host.

    python -m benchmarks.memory_model             # the table from the records
    python -m benchmarks.memory_model --predict   # freeze predictions for rows not compiled yet
    python -m benchmarks.memory_model --compile   # compile the rows without a record (minutes each)
    python -m benchmarks.memory_model --fit       # the constants that fit the fit rows best

Rows, by what the estimate's constants saw:
- fit: every compile recorded when the constants were last fitted (2026-12-04): the
  calibration rows of benchmarks/calibration.py, the spaces' trial 0, the rows held out from
  the earlier estimate, and every point of the search tables benchmarks/data/search_table.csv
  and search_table_b.csv (a table's points weigh as much as one row of the others, ten times:
  `--fit`);
- held-out: rows whose prediction was committed (results/memory_model/predictions.json, with
  the commit it came from) before they were compiled; and every point of the held-out search
  table benchmarks/data/search_table_c.csv, read against the screen's figures committed
  before it was compiled (search_table_c_screen.csv).
A row held out from an earlier estimate shows that estimate's frozen prediction beside
today's. The table reports the error of each set apart. Fidelity: estimate, against compile.

A new compiler makes new programs: each compiled record and each frozen prediction names the
libtpu it is for (`NAME | libtpu VERSION`; a plain NAME is libtpu 0.0.42.1's, the first), and
the table reads the installed compiler's. Rows are predicted and compiled again under it.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
from pathlib import Path
from typing import Any

import pandas as pd

from benchmarks.calibration import (
    PUBLISHED,
    compiled_by,
    compiler,
    frozen_key,
    git,
    recipe,
    record_path,
)
from benchmarks.search_efficiency import on_knobs, screen_path, space_path, table_path
from sweeper.search.ladder import typed_point
from sweeper.search.plan import compile_trial
from sweeper.space.load import load_space
from sweeper.space.points import assemble
from trainer.estimate import analytic
from trainer.estimate.analytic import memory_per_device
from trainer.trial.checks import check_static, global_batch_size
from trainer.trial.config import load_config
from trainer.trial.hardware import GIB, Topology

HERE = Path(__file__).resolve().parents[1] / "results" / "memory_model"
PREDICTIONS = HERE / "predictions.json"
COMPILED = HERE / "compiled.json"
# The estimate's constants and the range --fit searches for each.
CONSTANTS = {
    "LAYER_WEIGHT_BYTES": (0.0, 12.0),
    "LAYER_ACTIVATION_COPIES": (0.0, 6.0),
    "ROUTED_COPIES": (0.0, 12.0),
    "FP8_MLP_COPIES": (0.0, 6.0),
}
# Search tables whose every point was compiled: fit on, or held out (read against the screen
# committed before the compile: benchmarks/data/NAME_screen.csv).
FIT_TABLES = ("search_table", "search_table_b")
HELD_OUT_TABLES = ("search_table_c", "search_table_d", "search_table_e", "search_table_moe")
# In --fit, a row of a search table weighs 1/36, so a table weighs as one row ten times over
# (each other row weighs 0.1): the tables' 72 small programs do not outvote the recipes.
ROW_WEIGHT = 0.1

_70B_MINIMAL_CONTEXT = {"policy": "minimal_with_context"}
# Held out from the estimate before 2026-12-04's (their frozen predictions are that estimate's;
# fitted on since): chosen before their compile, among them `sweeper plan`'s advice.
EARLIER_HELD_OUT: dict[str, tuple[dict[str, Any], str]] = {
    "llama3.1-70b 8k full remat batch 1": (
        {"model": {"preset": "llama3.1-70b"}, "seq_len": 8192, "per_device_batch": 1,
         "mesh": {"fsdp": -1}, "remat": {"policy": "full"}},
        "tpu7x:4x4x4",
    ),
    "llama3.1-70b 8k plan advice": (
        {"model": {"preset": "llama3.1-70b"}, "seq_len": 8192, "per_device_batch": 0.5,
         "mesh": {"fsdp": -1, "tensor": 2}, "remat": _70B_MINIMAL_CONTEXT},
        "tpu7x:4x4x4",
    ),
    "mixtral-8x7b 4k plan advice": (
        {"model": {"preset": "mixtral-8x7b"}, "seq_len": 4096, "per_device_batch": 3,
         "mesh": {"fsdp": -1, "tensor": 4}, "remat": {"policy": "minimal_with_context"}},
        "tpu7x:4x4x4",
    ),
    # plan's mixtral advice once its first advice had run out of HBM and the MoE output was
    # counted (held out again: predicted before this compile).
    "mixtral-8x7b 4k plan advice, second": (
        {"model": {"preset": "mixtral-8x7b"}, "seq_len": 4096, "per_device_batch": 12,
         "mesh": {"fsdp": -1}, "remat": {"policy": "save_dot_except_mlp"}},
        "tpu7x:4x4x4",
    ),
    "llama3-8b 8k minimal batch 2": (
        {"model": {"preset": "llama3-8b"}, "seq_len": 8192, "per_device_batch": 2,
         "mesh": {"fsdp": -1}, "remat": {"policy": "minimal"}},
        "tpu7x:2x2x2",
    ),
}  # fmt: skip
# Held out from the estimate fitted on 2026-12-04: chosen, and predicted, before their compile.
HELD_OUT: dict[str, tuple[dict[str, Any], str]] = {
    "llama3-8b 8k tensor 2 full batch 4": (
        {"model": {"preset": "llama3-8b"}, "seq_len": 8192, "per_device_batch": 4,
         "mesh": {"fsdp": -1, "tensor": 2}, "remat": {"policy": "full"}},
        "tpu7x:2x2x2",
    ),
    "llama3-8b 8k save_dot batch 3 fp8": (
        {"model": {"preset": "llama3-8b"}, "seq_len": 8192, "per_device_batch": 3,
         "mesh": {"fsdp": -1}, "remat": {"policy": "save_dot_except_mlp"},
         "precision": {"mode": "fp8"}},
        "tpu7x:2x2x2",
    ),
    "llama3.1-70b 8k tensor 2 save_dot fp8": (
        {"model": {"preset": "llama3.1-70b"}, "seq_len": 8192, "per_device_batch": 1,
         "mesh": {"fsdp": -1, "tensor": 2}, "remat": {"policy": "save_dot_except_mlp"},
         "precision": {"mode": "fp8"}},
        "tpu7x:4x4x4",
    ),
    "mixtral-8x7b 4k full remat batch 8": (
        {"model": {"preset": "mixtral-8x7b"}, "seq_len": 4096, "per_device_batch": 8,
         "mesh": {"fsdp": -1}, "remat": {"policy": "full"}},
        "tpu7x:4x4x4",
    ),
}  # fmt: skip


def _trial_zero(space_name: str) -> tuple[dict[str, Any], str]:
    space = load_space(space_name)
    return assemble(space, space.search.warm_start[0]), str(space.target)


def rows() -> dict[str, tuple[dict[str, Any], str, str]]:
    """name: (trial config, target, set)."""
    out: dict[str, tuple[dict[str, Any], str, str]] = {}
    for name in PUBLISHED:
        config, target = recipe(name)
        out[name] = (config, target, "fit")
    for name, space in (
        ("llama3.1-70b 8k trial 0", "llama31_70b_8k_tpu7x"),
        ("llama3.1-405b 8k trial 0", "llama31_405b_8k_tpu7x"),
        ("qwen3-235b-a22b 4k trial 0", "qwen3_235b_4k_tpu7x"),
    ):
        config, target = _trial_zero(space)
        out[name] = (config, target, "fit")
    for name, (config, target) in EARLIER_HELD_OUT.items():
        out[name] = (config, target, "fit")
    for name, (config, target) in HELD_OUT.items():
        out[name] = (config, target, "held-out")
    return out


def table_points(name: str) -> list[tuple[dict[str, Any], str, float]]:
    """Every compiled point of a search table: (trial config, target, compiled GiB per device:
    the compiler's figure, also for a point over the space's budget)."""
    space = load_space(space_path(name))
    frame = pd.read_csv(table_path(name))
    knobs = [c for c in frame.columns if c.startswith("knob:")]
    out = []
    for _, row in frame[frame["hbm_per_device_gib"].notna()].iterrows():
        point = typed_point(space, row[knobs])
        out.append((assemble(space, point), str(space.target), float(row["hbm_per_device_gib"])))
    return out


def estimate_gib(config: dict[str, Any], target: str) -> float:
    trial = load_config({**config, "compile_target": target})
    devices = Topology.parse(target).devices
    degrees = check_static(trial, devices, "tpu")
    return memory_per_device(trial, degrees, global_batch_size(trial, devices))["total"] / GIB


def libtpu() -> str:
    return compiler()["libtpu"]


def record(name: str) -> dict[str, Any]:
    """The row's compile by the installed libtpu: memory per device, or a failure; {} if none.
    A calibration row's is its kept record (benchmarks.calibration), if that compiler made it."""
    calibrated = record_path(name)
    if calibrated.exists() and compiled_by(name).get("libtpu") == libtpu():
        return dict(json.loads(calibrated.read_text())["memory_per_device"])
    key = frozen_key(name, libtpu())
    memory = _read(COMPILED).get(key)
    if memory is None and key == name:
        memory = TRIAL_ZERO_COMPILED.get(name)
    return dict(memory or {})


def compiled_gib(name: str) -> float | None:
    """Arguments + temporaries per device, as the compiler reported them (host memory apart)."""
    memory = record(name)
    if "argument_size_in_bytes" not in memory:
        return None
    return (memory["argument_size_in_bytes"] + memory["temp_size_in_bytes"]) / GIB


# Trial 0 of the spaces, compiled as their headers record (libtpu 0.0.42.1, this host kind).
TRIAL_ZERO_COMPILED = {
    "llama3.1-70b 8k trial 0": {  # docs/facts.md: 5.15 + 87.16 GiB
        "argument_size_in_bytes": 5.15 * GIB,
        "temp_size_in_bytes": 87.16 * GIB,
    },
    "llama3.1-405b 8k trial 0": {"argument_size_in_bytes": 7.42 * GIB, "temp_size_in_bytes": 62.58 * GIB},
    "qwen3-235b-a22b 4k trial 0": {"argument_size_in_bytes": 5.14 * GIB, "temp_size_in_bytes": 73.95 * GIB},
}  # fmt: skip


def _read(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.exists() else {}


def predict() -> None:
    """Freeze the estimate of every held-out row the installed compiler has not compiled yet,
    with the commit it came from. Refused while the estimate has uncommitted changes."""
    dirty = git("status", "--porcelain", "trainer", "benchmarks/memory_model.py")
    if dirty:
        raise SystemExit(f"commit the estimate first; uncommitted:\n{dirty}")
    commit = git("rev-parse", "HEAD")
    if not commit:
        raise SystemExit("no commit to name: run --predict in the project's git checkout")
    frozen = _read(PREDICTIONS)
    for name, (config, target, kind) in rows().items():
        key = frozen_key(name, libtpu())
        if kind == "held-out" and not record(name) and key not in frozen:
            frozen[key] = {"est_gib": round(estimate_gib(config, target), 3), "commit": commit}
            print(f"{key}: predicted {frozen[key]['est_gib']:.2f} GiB per device")
    HERE.mkdir(parents=True, exist_ok=True)
    PREDICTIONS.write_text(json.dumps(frozen, indent=1) + "\n")


def compile_rows(kinds: tuple[str, ...]) -> None:
    """Compile, with the installed libtpu, each row of `kinds` it has not compiled; a
    held-out row only once its prediction for this compiler is frozen."""
    frozen = _read(PREDICTIONS)
    for name, (config, target, kind) in rows().items():
        key = frozen_key(name, libtpu())
        if kind not in kinds or record(name):
            continue
        if kind == "held-out" and key not in frozen:
            raise SystemExit(f"{key}: no frozen prediction; run --predict and commit it first")
        print(f"compiling {name} for {target} with libtpu {libtpu()} ...", flush=True)
        memory = _compile(config, target)
        compiled = _read(COMPILED)  # read again: a compile takes minutes
        compiled[key] = memory
        COMPILED.write_text(json.dumps(compiled, indent=1) + "\n")


def _compile(config: dict[str, Any], target: str) -> dict[str, Any]:
    done = compile_trial(config, target)
    assert done is not None  # no timeout
    events, stderr = done
    if "compiled" in events:
        return dict(events["compiled"]["memory_per_device"])
    failure = events.get("failure", {})
    # An oom_hbm is a compiled answer too: the compiler's figure is in its message.
    return {
        "failure": failure.get("failure_class", "crashed"),
        "message": failure.get("message", stderr[-800:]),
    }


def _oom_gib(record: dict[str, Any]) -> float | None:
    """A compile that ran out of HBM states its temporaries: at least that much was needed."""
    match = re.search(r"HLO temporaries \(([0-9.]+)G\)", record.get("message", ""))
    return float(match.group(1)) if match else None


def _summary(label: str, values: list[float]) -> None:
    if values:
        print(f"{label}: {len(values)} rows, median |error| {statistics.median(values):.1%}, "
              f"max {max(values):.1%}")  # fmt: skip


def table() -> None:
    """Each row's estimate against its compile. A held-out row shows its frozen prediction
    (the error that counts) and today's estimate beside it (made after it was seen); a row
    held out from an earlier estimate shows that estimate's frozen prediction."""
    frozen = _read(PREDICTIONS)
    errors: dict[str, list[float]] = {"fit": [], "held-out": [], "earlier": []}
    print(f"compiler: libtpu {libtpu()} (its compiles and the predictions frozen for them)")
    print(f"{'row':40s} {'set':9s} {'estimate':>9s} {'compiled':>10s} {'error':>7s}  beside")
    for name, (config, target, kind) in rows().items():
        now = estimate_gib(config, target)
        key = frozen_key(name, libtpu())
        if kind == "held-out" and key not in frozen:
            note = "not predicted for this compiler" if record(name) else "not compiled yet"
            print(f"{name:40s} {kind:9s} {now:8.1f}G {'-':>10s} {'':>7s}  {note}")
            continue
        est = frozen[key]["est_gib"] if kind == "held-out" else now
        compiled = record(name)
        if not compiled:
            print(f"{name:40s} {kind:9s} {est:8.1f}G {'-':>10s} {'':>7s}  not compiled yet")
            continue
        if "failure" in compiled:
            floor = _oom_gib(compiled)
            got_text = f">{floor:.1f}G" if floor else compiled["failure"]
            error = est / floor - 1 if floor else math.nan
            print(f"{name:40s} {kind:9s} {est:8.1f}G {got_text:>10s} {error:+7.1%}  "
                  f"{compiled['failure']}: the compiler's temporaries alone")  # fmt: skip
            if floor:
                errors[kind].append(abs(error))
            continue
        got = compiled_gib(name)
        assert got is not None, name
        error = est / got - 1
        errors[kind].append(abs(error))
        beside = ""
        if kind == "held-out":
            beside = f"now {now:.1f}G ({now / got - 1:+.1%})"
        elif name in EARLIER_HELD_OUT and key in frozen:
            earlier = frozen[key]["est_gib"] / got - 1
            errors["earlier"].append(abs(earlier))
            beside = (
                f"frozen by the earlier estimate: {frozen[key]['est_gib']:.1f}G ({earlier:+.1%})"
            )
        print(f"{name:40s} {kind:9s} {est:8.1f}G {got:9.1f}G {error:+7.1%}  {beside}")
    for name in (*FIT_TABLES, *HELD_OUT_TABLES):
        kind = "fit" if name in FIT_TABLES else "held-out"
        found = table_errors(name, frozen_screen=kind == "held-out")
        if found is None:
            print(f"{name:40s} {kind:9s} not compiled yet")
            continue
        errors[kind] += found
        print(f"{name:40s} {kind:9s} {len(found)} points: median |error| "
              f"{statistics.median(found):.1%}, max {max(found):.1%}")  # fmt: skip
    _summary("fit", errors["fit"])
    _summary("held-out", errors["held-out"])
    _summary("held out from the earlier estimate (its frozen predictions)", errors["earlier"])
    print("fidelity: estimate against compile (libtpu, TPU7x topologies, on a CPU host)")


def table_errors(name: str, frozen_screen: bool) -> list[float] | None:
    """|error| of each compiled point of a search table: today's estimate, or for a held-out
    table the screen's figure committed before its compile."""
    if not table_path(name).exists():
        return None
    points = table_points(name)
    if not frozen_screen:
        return [abs(estimate_gib(config, target) / got - 1) for config, target, got in points]
    both = on_knobs(pd.read_csv(table_path(name)), pd.read_csv(screen_path(name)))
    both = both[both["hbm_per_device_gib"].notna()]
    return list((both["est_hbm_per_device_gib"] / both["hbm_per_device_gib"] - 1).abs())


def fit() -> dict[str, float]:
    """The constants (CONSTANTS) that make the fit rows' errors least in the weighted least
    squares (a search table's point 1/36, another row ROW_WEIGHT), on the installed
    compiler's compiles; prints them and the errors, changes nothing."""
    from scipy.optimize import least_squares

    fit_rows = {n: (c, t) for n, (c, t, k) in rows().items() if k == "fit"}
    missing = [n for n in fit_rows if not record(n)]
    if missing:
        raise SystemExit(f"not compiled by libtpu {libtpu()}: {missing}; run --compile first")
    got = {n: compiled_gib(n) for n in fit_rows}
    fitted = [(*fit_rows[n], g, ROW_WEIGHT) for n, g in got.items() if g is not None]
    floors = [n for n, g in got.items() if g is None]  # out of HBM: a floor, no figure to fit
    for name in FIT_TABLES:
        points = table_points(name)
        fitted += [(c, t, got, 1 / len(points)) for c, t, got in points]
    kept = {k: getattr(analytic, k) for k in CONSTANTS}

    def residuals(values: list[float]) -> list[float]:
        for k, v in zip(CONSTANTS, values, strict=True):
            setattr(analytic, k, float(v))
        return [(estimate_gib(c, t) / got - 1) * w**0.5 for c, t, got, w in fitted]

    try:
        lower, upper = zip(*CONSTANTS.values(), strict=True)
        best = least_squares(residuals, list(kept.values()), bounds=(lower, upper))
        values = {k: round(float(v), 2) for k, v in zip(CONSTANTS, best.x, strict=True)}
        residuals(list(values.values()))
        errors = [abs(estimate_gib(c, t) / got - 1) for c, t, got, _ in fitted]
    finally:
        for k, v in kept.items():
            setattr(analytic, k, v)
    print(f"fit on {len(fitted)} compiles (libtpu {libtpu()}; not {floors}: out of HBM): "
          + ", ".join(f"{k} {v}" for k, v in values.items()))  # fmt: skip
    _summary("fit", errors)
    return values


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--predict", action="store_true")
    parser.add_argument(
        "--compile",
        action="store_true",
        help="compile the fit rows, and the held-out rows frozen",
    )
    parser.add_argument(
        "--compile-only",
        choices=("fit", "held-out"),
        nargs="+",
        help="compile only the rows of these sets",
    )
    parser.add_argument("--fit", action="store_true")
    args = parser.parse_args()
    if args.predict:
        predict()
    if args.compile or args.compile_only:
        compile_rows(tuple(args.compile_only or ("fit", "held-out")))
    if args.fit:
        fit()
        return
    table()


if __name__ == "__main__":
    main()
