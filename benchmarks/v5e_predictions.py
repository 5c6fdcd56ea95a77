"""The step model held to the lent TPU v5e: every point of a v5e space predicted (estimate and
compile fidelity, for v5e:1x1) before the chip measures it, then the predictions against the
measurements.

    python -m benchmarks.v5e_predictions freeze SPACE [COMPILE_SWEEP_DIR]
        # writes benchmarks/data/SPACE_predictions.csv: commit it before any measurement lands
        # (without a compile sweep: the estimate's predictions alone)
    python -m benchmarks.v5e_predictions compare SPACE [--measured CSV ...]

`freeze` judges every point by the analytic estimate (the screen, in this process) and reads
each point's compile-fidelity trial from a finished compile sweep of the space for v5e:1x1
(`sweeper run` of the space with fidelity compile and every point as warm start, on the
chip's own JAX and libtpu: benchmarks/v5e/README.md). `compare` joins them with the chip's
measurements (benchmarks/data/SPACE_grid.csv, the sweep's trials) by the point's knobs and
prints, per fidelity, Spearman's rank correlation and the median |error| of tokens/s per
chip, memory against the chip's compiled memory, and every out-of-memory: measured, and
whether each fidelity predicted it.
"""

from __future__ import annotations

import argparse
import csv
import gzip
import json
import math
import statistics
import subprocess
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from benchmarks.tables import compact

DATA = Path(__file__).resolve().parent / "data"
TARGET = "v5e:1x1"
INTERNAL = ("sweeper.",)  # the searcher's own keys in a trial's config (optuna number, repeats)


def key_of(point: dict[str, Any]) -> str:
    """A point's identity across files: its knobs, sorted, as JSON."""
    return json.dumps({k: point[k] for k in sorted(point) if not k.startswith(INTERNAL)})


def _commit() -> str:
    done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                          cwd=DATA)  # fmt: skip
    return done.stdout.strip() or "unknown"


def estimates(space_name: str) -> dict[str, dict[str, Any]]:
    """Every point's estimate for v5e:1x1 (the screen's judgement), by key."""
    from sweeper.search.screen import screen
    from sweeper.space.load import load_space
    from sweeper.space.points import points

    space = load_space(
        space_name,
        {
            "target": TARGET,
            "fidelity": "compile",
            "objective.primary.metric": "est_tokens_per_sec_per_chip",
        },
    )
    names = list(space.knobs)
    frame = screen(space)
    out = {}
    for point, row in zip(points(space, 10_000), _rows_in_point_order(frame, space), strict=True):
        out[key_of(point)] = {
            "est_tokens_per_sec_per_chip": row.get("est_tokens_per_sec_per_chip"),
            "est_hbm_gib": row.get("est_hbm_per_device_gib"),
            "est_verdict": row.get("verdict"),
        }
    assert len(out) == len(points(space, 10_000)), names
    return out


def _rows_in_point_order(frame: Any, space: Any) -> list[dict[str, Any]]:
    """The screen's rows (it sorts them by rank) back in the order of `points(space)`."""
    from sweeper.record.row import knob_column
    from sweeper.space.points import points

    columns = [knob_column(k) for k in space.knobs]
    rows = frame.to_dict("records")

    def same(row: dict[str, Any], point: dict[str, Any]) -> bool:
        for name, column in zip(space.knobs, columns, strict=True):
            value = row.get(column)
            missing = value is None or (isinstance(value, float) and math.isnan(value))
            if (name in point) == missing or (name in point and value != point[name]):
                return False
        return True

    return [next(r for r in rows if same(r, p)) for p in points(space, 10_000)]


def compiled(sweep_dir: Path) -> dict[str, dict[str, Any]]:
    """Each point's compile-fidelity trial (its config and result) from a compile sweep run
    without Ray (its host_trials.json), by key."""
    from trainer.trial.result import TrialResult

    trials = json.loads((sweep_dir / "host_trials.json").read_text())
    out = {}
    for trial in trials:
        result = TrialResult.from_report(trial["last_result"])
        if result is None:
            continue
        failure = result.failure_class.value if result.failure_class else ""
        out[key_of(trial["config"])] = {
            "compile_status": failure or result.status.value,
            "compile_est_tokens_per_sec_per_chip": result.figure("est_tokens_per_sec_per_chip"),
            "compile_hbm_gib": result.figure("hbm_per_device_gib") or result.needed_gib,
        }
    return out


def freeze(space_name: str, sweep_dir: Path | None) -> Path:
    """Every point's predictions, written before the chip measures any: the estimate's, and
    compile fidelity's from `sweep_dir` (None: the estimate's alone, compile_status not_run)."""
    est = estimates(space_name)
    if sweep_dir is None:
        comp: dict[str, dict[str, Any]] = {}
        source, absent, missing = "no compile fidelity (the estimate alone)", "not_run", []
    else:
        comp = compiled(sweep_dir)
        sweep_id = json.loads((sweep_dir / "sweep.json").read_text())["sweep_id"]
        source, absent = f"compile fidelity from sweep {sweep_id}", "missing"
        missing = sorted(set(est) - set(comp))
    path = DATA / f"{space_name}_predictions.csv"
    fields = ["key", "est_tokens_per_sec_per_chip", "est_hbm_gib", "est_verdict",
              "compile_status", "compile_est_tokens_per_sec_per_chip", "compile_hbm_gib"]  # fmt: skip
    with path.open("w", newline="") as f:
        f.write(f"# {space_name}: every point predicted for {TARGET} before the chip measured it. "
                f"Model at commit {_commit()} (plus the working tree this file was written "
                f"from); {source}.\n")  # fmt: skip
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        for key, row in est.items():
            writer.writerow({"key": key, **row, **comp.get(key, {"compile_status": absent})})
    if missing:
        print(f"{len(missing)} point(s) have no compile trial: {missing[:3]}")
    return path


def _read(path: Path) -> list[dict[str, str]]:
    with path.open() as f:
        return list(csv.DictReader(line for line in f if not line.startswith("#")))


def _number(value: str | None) -> float | None:
    try:
        number = float(value) if value not in (None, "") else None
    except ValueError:
        return None
    return number if number is not None and math.isfinite(number) else None


def spearman(xs: list[float], ys: list[float]) -> float:
    """Spearman's rank correlation (average ranks for ties)."""

    def ranks(values: list[float]) -> list[float]:
        order = sorted(range(len(values)), key=lambda i: values[i])
        out = [0.0] * len(values)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
                j += 1
            for k in range(i, j + 1):
                out[order[k]] = (i + j) / 2
            i = j + 1
        return out

    rx, ry = ranks(xs), ranks(ys)
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry, strict=True))
    var = math.sqrt(sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry))
    return cov / var if var else float("nan")


def measured_of(space_name: str, grid: Path) -> dict[str, dict[str, Any]]:
    """The chip's measurement of each point of the grid (benchmarks/space_grid.py's csv)."""
    from sweeper.space.load import load_space

    names = list(load_space(space_name).knobs)
    out = {}
    for row in _read(grid):
        point = {}
        for name in names:
            value = row.get(name)
            if value in (None, ""):
                continue
            point[name] = int(value) if value.isdigit() else value
        out[key_of(point)] = row
    return out


# The split the step model is mended on, by space (docs/calibration.md, "TPU v5e"): the knob
# that splits it and, by side, its value. v5e_dense's constants are fitted on its points at
# batch 8 and held to those at batch 16, which they were not shaped on (a point's twin in
# layout alone, a near copy of it, stays on its side); v5e_moe's routing constant on its
# points at full remat, held to those at minimal remat. A space not here is held out whole.
SPLITS: dict[str, tuple[str, dict[str, Any]]] = {
    "v5e_dense": ("per_device_batch", {"fit (batch 8)": 8, "held out (batch 16)": 16}),
    "v5e_moe": ("remat.policy", {"fit (remat full)": "full", "held out (minimal)": "minimal"}),
    # its points without a shared expert are v5e_moe's (measured there: seen)
    "v5e_moe_shared": (
        "model.shared_experts",
        {"seen (none)": 0, "held out (1 shared)": 1, "held out (2 shared)": 2},
    ),
}


def _side(space_name: str, key: str) -> Any:
    """The value of the knob that splits `space_name`'s points, at the point `key`."""
    return json.loads(key).get(SPLITS[space_name][0])


def predicted_oom(row: dict[str, str], fidelity: str) -> bool:
    if fidelity == "estimate":
        return row["est_verdict"] != "fits"
    return "oom" in row["compile_status"]


def compare(
    space_name: str, grid: Path, console: Console, predictions_csv: Path | None = None
) -> dict[str, Any]:
    """Each fidelity's predictions against the chip, over every point and per split."""
    path = predictions_csv or DATA / f"{space_name}_predictions.csv"
    predictions = {r["key"]: r for r in _read(path)}
    measured = measured_of(space_name, grid)
    both = [k for k in predictions if k in measured]
    summary: dict[str, Any] = {"points": len(both)}
    table = compact(f"{space_name}: {path.name} against the chip (run fidelity, TPU v5e)")
    for col in ("fidelity, points", "n", "Spearman", "median |error|", "memory |error|",
                "OOM caught", "OOM said, ran"):  # fmt: skip
        table.add_column(col, justify="left" if col.startswith("fidelity") else "right")
    splits = SPLITS[space_name][1] if space_name in SPLITS else {}
    for split, side in {"all" if splits else "all (held out)": None, **splits}.items():
        keys = [k for k in both if side is None or _side(space_name, k) == side]
        summary[split] = _compare_rows(predictions, measured, keys, table, split)
    console.print(table)
    return summary


def _compare_rows(
    predictions: dict[str, dict[str, str]],
    measured: dict[str, dict[str, str]],
    keys: list[str],
    table: Table,
    split: str,
) -> dict[str, Any]:
    ok = [k for k in keys if measured[k]["status"] == "ok"]
    ooms = [k for k in keys if "oom" in (measured[k].get("failure") or "")]
    out: dict[str, Any] = {}
    for fidelity, column, hbm in (("estimate", "est_tokens_per_sec_per_chip", "est_hbm_gib"),
                                  ("compile", "compile_est_tokens_per_sec_per_chip",
                                   "compile_hbm_gib")):  # fmt: skip
        pairs = [(_number(predictions[k][column]), _number(measured[k]["tokens_per_sec_per_chip"]))
                 for k in ok]  # fmt: skip
        pairs = [(p, m) for p, m in pairs if p is not None and m is not None]
        errors = [abs(p / m - 1) for p, m in pairs]
        memory = [(_number(predictions[k][hbm]), _number(measured[k]["hbm_per_device_gib"]))
                  for k in ok]  # fmt: skip
        memory_errors = [abs(p / m - 1) for p, m in memory if p and m]
        caught = sum(predicted_oom(predictions[k], fidelity) for k in ooms)
        false = sum(predicted_oom(predictions[k], fidelity) for k in ok)
        rho = spearman([p for p, _ in pairs], [m for _, m in pairs]) if len(pairs) > 2 else None
        med = statistics.median(errors) if errors else None
        out[fidelity] = {"spearman": rho, "median_abs_error": med, "points": len(pairs),
                         "ooms_caught": caught, "ooms": len(ooms), "false_ooms": false}  # fmt: skip
        table.add_row(
            f"{fidelity}, {split}", str(len(pairs)),
            f"{rho:.3f}" if rho is not None else "-",
            f"{med:.1%}" if med is not None else "-",
            f"{statistics.median(memory_errors):.1%}" if memory_errors else "-",
            f"{caught} of {len(ooms)}", f"{false} of {len(ok)}",
        )  # fmt: skip
    return out


def search(space_name: str, sweep_dir: Path, grid: Path, console: Console) -> dict[str, Any]:
    """The sweep against the grid: its trial 0, its best, and the first trial (in the order
    they ran) within 2% of the grid's best, by each point's figure in the sweep's own table."""
    measured = measured_of(space_name, grid)
    grid_ok = [(float(r["tokens_per_sec_per_chip"]), k) for k, r in measured.items()
               if r["status"] == "ok" and r.get("tokens_per_sec_per_chip")]  # fmt: skip
    grid_best, grid_key = max(grid_ok)
    with (sweep_dir / "summary.csv").open() as f:
        rows = [r for r in csv.DictReader(f) if not r.get("remeasure_of")]
    # In the order the search drew them (Optuna's trial numbers); a trial cut off (killed,
    # unmeasured) counts as a trial spent.
    rows.sort(key=lambda r: n if (n := _number(r.get("optuna_trial"))) is not None else math.inf)
    figures = [_number(r.get("tokens_per_sec_per_chip")) for r in rows]
    reached = next((i + 1 for i, v in enumerate(figures) if v and v >= 0.98 * grid_best), None)
    best_i = max(range(len(rows)), key=lambda i: figures[i] or 0.0)
    knobs = lambda r: {k.removeprefix("knob:"): v for k, v in r.items()  # noqa: E731
                       if k.startswith("knob:") and v not in ("", None)}  # fmt: skip
    out = {
        "trials": len(rows),
        "grid_points": len(measured),
        "grid_best": grid_best,
        "grid_best_point": json.loads(grid_key),
        "trial0": figures[0],
        "trial0_point": knobs(rows[0]),
        "sweep_best": figures[best_i],
        "sweep_best_point": knobs(rows[best_i]),
        "first_within_2pct": reached,
    }
    table = compact(f"{space_name}: sweep {sweep_dir.name} against the grid of "
                    f"{len(measured)} points (run fidelity, TPU v5e)")  # fmt: skip
    for col in ("", "tokens/s/chip", "of the grid's best", "point"):
        table.add_column(col)
    for name, value, point in (("trial 0", out["trial0"], out["trial0_point"]),
                               ("sweep best", out["sweep_best"], out["sweep_best_point"]),
                               ("grid best", grid_best, out["grid_best_point"])):  # fmt: skip
        table.add_row(name, f"{value:,.0f}" if value else "-",
                      f"{value / grid_best:.1%}" if value else "-",
                      " ".join(f"{k.split('.')[-1]}={v}" for k, v in point.items()))  # fmt: skip
    table.caption = (f"first trial within 2% of the grid's best: "
                     f"{reached or 'none'} of {len(rows)}")  # fmt: skip
    console.print(table)
    return out


def replay(space_name: str, grid: Path, seeds: int, console: Console) -> dict[str, Any]:
    """The engine's own search (SweepSearch: the space's sampler, its warm start as trial 0,
    distinct points) told the chip's measurement of each point it asks for, from the
    measured grid: how many trials it spends to come within 2% of the grid's best, over
    `seeds` seeds, against the same with the random sampler. A replay on the chip's
    figures (fidelity run, TPU v5e), not trials run on it: each point's figure is the grid's
    (a point's figure there is its own: the sweep's trials on the chip matched the grid's
    within 0.05%)."""
    import optuna

    from sweeper.search.distributions import make_sampler
    from sweeper.search.searcher import SweepSearch
    from sweeper.space.load import load_space
    from sweeper.space.points import knob_point
    from trainer.trial.events import FailureClass, Fidelity, TrialStatus
    from trainer.trial.result import TrialResult

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    measured = measured_of(space_name, grid)
    best = max(float(r["tokens_per_sec_per_chip"]) for r in measured.values()
               if r["status"] == "ok")  # fmt: skip
    out: dict[str, Any] = {"grid_points": len(measured), "grid_best": best}
    for sampler in ("tpe", "random"):
        spent = []
        for seed in range(seeds):
            space = load_space(space_name, {"search.seed": seed, "search.sampler": sampler,
                                            "search.remeasure": 0})  # fmt: skip
            search = SweepSearch(
                space, sweep_id=f"replay-{seed}", metric="tokens_per_sec_per_chip", mode="max",
                sampler=make_sampler(space), study_name=f"replay-{sampler}-{seed}",
                storage=optuna.storages.InMemoryStorage(),
                points_to_evaluate=space.search.warm_start or None,
            )  # fmt: skip
            reached = None
            for i in range(len(measured)):
                config = search.suggest(f"t{i}")
                if not isinstance(config, dict):
                    break
                row = measured[key_of(knob_point(config))]
                if row["status"] == "ok":
                    figure = float(row["tokens_per_sec_per_chip"])
                    result = TrialResult(status=TrialStatus.OK, fidelity=Fidelity.RUN,
                                         figures={"tokens_per_sec_per_chip": figure})  # fmt: skip
                    if reached is None and figure >= 0.98 * best:
                        reached = i + 1
                else:
                    result = TrialResult.failed(FailureClass.OOM_HBM, row.get("failure") or "")
                search.on_trial_complete(
                    f"t{i}", result=result.to_report(["tokens_per_sec_per_chip"])
                )
                if reached is not None:
                    break
            spent.append(reached or len(measured) + 1)
        out[sampler] = spent
        console.print(f"{sampler}: trials to within 2% of the grid's best ({best:,.0f}) over "
                      f"{seeds} seeds: median {statistics.median(spent)}, mean "
                      f"{statistics.mean(spent):.1f}, at most {max(spent)}; "
                      f"{sum(s <= len(measured) // 2 for s in spent)} of {seeds} within half the "
                      f"grid ({len(measured) // 2})")  # fmt: skip
    return out


# The estimate's constants each space's mend fits (trainer/estimate/analytic.py), with
# where least squares starts and its bounds.
FITS: dict[str, dict[str, tuple[float, float, float]]] = {
    "v5e_dense": {"score_passes": (2.0, 0, 20), "mxu_efficiency": (0.77, 0.3, 1),
                  "int8_mxu_efficiency": (0.77, 0.3, 1), "fp8_mxu_efficiency": (0.72, 0.3, 1),
                  "layer_passes": (4.039, 0, 20), "saved_passes": (8.153, 0, 40)},
    "v5e_moe": {"routing": (1.0, 0, 50)},
}  # fmt: skip


def _set_constants(values: dict[str, float]) -> None:
    """The analytic estimate's fitted constants (trainer/estimate/analytic.py), in place."""
    from trainer.estimate import analytic

    if "score_passes" in values:  # XLA's program's, not the chip's: every accelerator's
        analytic.STEP_CONSTANTS["score_passes"] = values["score_passes"]
    analytic.ACCELERATOR_CONSTANTS["v5e"].update(
        {k: v for k, v in values.items() if k != "score_passes"}
    )


def _estimates_of(space_name: str, keys: list[str]) -> list[float]:
    from sweeper.space.checks import static_check
    from sweeper.space.load import load_space
    from trainer.estimate.analytic import estimate
    from trainer.trial.hardware import ACCELERATORS

    space = load_space(space_name)
    accel = ACCELERATORS["v5e"]
    return [estimate(static_check(space, json.loads(k), 1), accel, 1)["est_tokens_per_sec_per_chip"]
            for k in keys]  # fmt: skip


def fit(space_name: str, grid: Path, console: Console) -> dict[str, float]:
    """The estimate's v5e constants (FITS) by least squares of log tokens/s on the fit
    split's measured points; the held-out split is not read."""
    import numpy as np
    from scipy.optimize import least_squares

    measured = measured_of(space_name, grid)
    label, side = next(iter(SPLITS[space_name][1].items()))
    keys = [k for k, r in measured.items()
            if r["status"] == "ok" and _side(space_name, k) == side]  # fmt: skip
    truth = np.log([float(measured[k]["tokens_per_sec_per_chip"]) for k in keys])
    names = list(FITS[space_name])

    def residuals(theta: Any) -> Any:
        _set_constants(dict(zip(names, theta, strict=True)))
        return np.log(_estimates_of(space_name, keys)) - truth

    start, low, high = zip(*FITS[space_name].values(), strict=True)
    found = least_squares(residuals, start, bounds=(low, high))
    values = dict(zip(names, (float(v) for v in found.x), strict=True))
    console.print(f"fitted on {len(keys)} points, {label}: "
                  f"{json.dumps({k: round(v, 4) for k, v in values.items()})}; "
                  f"rms log error {float(np.sqrt(np.mean(found.fun**2))):.4f}")  # fmt: skip
    return values


def reread(sweep_dir: Path) -> dict[str, dict[str, Any]]:
    """Each point's compile-fidelity figures read again, by today's step model, from the
    programs its compile sweep compiled (each trial's `compiled` event keeps the program's
    memory and counted cost): no compile is run again. A point libtpu refused has none."""
    from trainer.compile.aot import compile_summary
    from trainer.trial.checks import global_batch_size
    from trainer.trial.config import TrialConfig
    from trainer.trial.hardware import Topology

    experiment = next((sweep_dir.parents[1] / "ray").glob(f"*-{sweep_dir.name}"))
    out = {}
    for trial in json.loads((sweep_dir / "host_trials.json").read_text()):
        folder = experiment / f"trial_{trial['trial_id']}"
        config = TrialConfig.from_json((folder / "trial.json").read_text())
        log = folder / "trainer.log"
        text = log.read_text() if log.exists() else gzip.decompress(
            (folder / "trainer.log.gz").read_bytes()).decode()  # fmt: skip
        events = [json.loads(line) for line in text.splitlines() if line.startswith("{")]
        compiled = next((e for e in events if e["event"] == "compiled"), None)
        key = key_of(trial["config"])
        if compiled is None:
            failure = next((e for e in events if e["event"] == "failure"), {})
            out[key] = {"compile_status": failure.get("failure_class", "missing"),
                        "compile_est_tokens_per_sec_per_chip": None, "compile_hbm_gib": None}  # fmt: skip
            continue
        topology = Topology.parse(TARGET)
        batch = global_batch_size(config, topology.devices)
        record = {"compile_s": compiled["compile_s"], "fingerprint": "",
                  "memory_per_device": compiled["memory_per_device"],
                  "collectives": compiled.get("collectives", {}),
                  "cost": compiled["program_cost"]}  # fmt: skip
        degrees = config.mesh.resolve(topology.devices)
        summary = compile_summary(config, batch, degrees, topology, record)
        out[key] = {"compile_status": "ok",
                    "compile_est_tokens_per_sec_per_chip": summary["est_tokens_per_sec_per_chip"],
                    "compile_hbm_gib": summary["hbm_per_device_gib"]}  # fmt: skip
    return out


def predict(space_name: str, path: Path, compile_sweep: Path | None = None) -> Path:
    """Today's estimate of every point and, given its compile sweep, its compile-fidelity
    figures re-read by today's step model from the same programs (else the frozen ones)."""
    rows = _read(DATA / f"{space_name}_predictions.csv")
    fresh = estimates(space_name)
    if compile_sweep is not None:
        again = reread(compile_sweep)
        fresh = {k: {**v, **again.get(k, {})} for k, v in fresh.items()}
    with path.open("w", newline="") as f:
        f.write(
            f"# {space_name}: predictions remade at commit {_commit()} after the chip's "
            "measurements entered (the fit split shaped them, the held-out split did not): "
            "the estimate recomputed; compile fidelity "
            + ("re-read from the same programs" if compile_sweep else "as frozen")
            + ".\n"
        )
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        for row in rows:
            writer.writerow({**row, **fresh[row["key"]]})
    return path


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    f = sub.add_parser("freeze")
    f.add_argument("space")
    f.add_argument("sweep_dir", type=Path, nargs="?", default=None)
    c = sub.add_parser("compare")
    c.add_argument("space")
    c.add_argument("--grid", type=Path, default=None)
    c.add_argument("--predictions", type=Path, default=None)
    sub.add_parser("fit").add_argument("space")
    pr = sub.add_parser("predict")
    pr.add_argument("space")
    pr.add_argument("out", type=Path)
    pr.add_argument("--compile-sweep", type=Path, default=None)
    rp = sub.add_parser("replay")
    rp.add_argument("space")
    rp.add_argument("--seeds", type=int, default=20)
    e = sub.add_parser("search")
    e.add_argument("space")
    e.add_argument("sweep_dir", type=Path)
    e.add_argument("--grid", type=Path, default=None)
    args = parser.parse_args()
    console = Console(width=80)
    if args.command == "freeze":
        console.print(str(freeze(args.space, args.sweep_dir)))
    elif args.command == "replay":
        replay(args.space, DATA / f"{args.space}_grid.csv", args.seeds, console)
    elif args.command == "fit":
        fit(args.space, DATA / f"{args.space}_grid.csv", console)
    elif args.command == "predict":
        console.print(str(predict(args.space, args.out, args.compile_sweep)))
    elif args.command == "compare":
        compare(args.space, args.grid or DATA / f"{args.space}_grid.csv", console,
                args.predictions)  # fmt: skip
    else:
        search(args.space, args.sweep_dir, args.grid or DATA / f"{args.space}_grid.csv", console)


if __name__ == "__main__":
    main()
