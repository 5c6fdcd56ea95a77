"""Every point of a space measured on this host's devices: the measured optimum a sweep of the
space is held to (benchmarks/v5e/README.md).

    python -m benchmarks.space_grid SPACE [--devices N] [--set KEY=VALUE ...] [--out DIR]
                                          [--timeout S] [--only I,J,...]

Each point is the trial configuration a sweep's trial of it runs (the space's base, the
point, every JAX-free check), trained by the trainer's own `train` at run fidelity with its
convergence check, its failure classified as a trial's. Points whose trials pass libtpu the
same flags run in turn in one process started with those flags, as `python -m trainer`
starts (trainer/cli.py's prepare_environment: libtpu reads its flags once, when it starts);
a process per point would cost a TPU's start-up (about 10 s) each time. A point that fails
does not stop its group; a group whose process dies is said so, point by point.

Writes DIR/grid.csv (one row per point: its knobs, status, tokens/s/chip with its 95%
interval, MFU, HBM, compile and wall seconds, convergence) and prints a table. Fidelity: run,
on this host's devices (on a CPU host: simulated devices, a check of the path, no finding).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

DEADLINE_ENV = "SWEEPER_GRID_DEADLINE"  # the group's process starts no point past this time
FIGURES = (
    "tokens_per_sec_per_chip",
    "tokens_per_sec_per_chip_low",
    "tokens_per_sec_per_chip_high",
    "mfu",
    "hbm_per_device_gib",
    "peak_hbm_per_device_gib",
    "compile_s",
    "step_time_median_s",
)


def configs_of(space_ref: str, sets: list[str], devices: int, cache: Path) -> list[dict]:
    """Each point of the space: its knobs and its trial configuration (or why it has none)."""
    from sweeper.cli.app import overrides
    from sweeper.space.checks import check_space, static_check
    from sweeper.space.load import load_space
    from sweeper.space.points import points
    from trainer.trial.config import ConfigError

    space = load_space(space_ref, overrides(None, None, None, None, sets))
    space, _ = check_space(space)
    rows = []
    for point in points(space, 10_000):
        try:
            config = static_check(space, point, devices)
        except ConfigError as exc:
            rows.append({"knobs": point, "error": f"invalid_config: {exc.field}: {exc.message}"})
            continue
        convergence = config.convergence.model_copy(update={"cache_dir": str(cache)})
        config = config.model_copy(update={"convergence": convergence, "num_devices": devices})
        rows.append({"knobs": point, "config": config.model_dump(mode="json")})
    return rows


def child(group_file: str) -> None:
    """Train each point of the group in turn, a RESULT line each (the process's flags are
    the group's: the parent started it with them)."""
    import gc

    from trainer.cli import prepare_environment
    from trainer.trial.config import ConfigError, load_config
    from trainer.trial.events import Emitter, FailureClass, TrialFailure, classify_exception

    group = json.loads(Path(group_file).read_text())
    deadline = float(os.environ.get(DEADLINE_ENV, "inf"))
    configs = [load_config(item["config"]) for item in group]
    prepare_environment(configs[0])
    from trainer.run.train import train  # JAX starts here, under the group's flags

    for item, config in zip(group, configs, strict=True):
        if time.time() > deadline:
            print("RESULT " + json.dumps({"index": item["index"], "status": "not_run",
                                          "failure": "not measured: --budget spent"}), flush=True)  # fmt: skip
            continue
        start = time.perf_counter()
        emitter = Emitter(quiet=True)
        row: dict[str, Any] = {"index": item["index"]}
        try:
            summary = train(config, emitter).summary
            row.update({k: summary.get(k) for k in FIGURES})
            judged = summary.get("convergence")
            row["convergence"] = None if judged is None else judged["passed"]
            row["status"] = "ok" if judged is None or judged["passed"] else "diverged"
        except ConfigError as exc:
            row.update(status="failed", failure=f"invalid_config: {exc.field}: {exc.message}")
        except TrialFailure as exc:
            row.update(status="failed", failure=f"{exc.failure_class.value}: {exc}"[:400])
        except Exception as exc:  # classified as a trial's, never lost
            ran = any(e["event"] in ("compiled", "step") for e in emitter.events)
            failure: FailureClass = classify_exception(exc, "run" if ran else "compile")
            row.update(status="failed", failure=f"{failure.value}: {type(exc).__name__}: "
                                                f"{str(exc)[:300]}")  # fmt: skip
        row["wall_s"] = time.perf_counter() - start
        times = {e["event"]: e["time"] for e in reversed(emitter.events)}  # each one's first
        if "compiled" in times and "step" in times:  # what the first step waited on besides
            row["to_first_step_s"] = times["step"] - times["compiled"]
        print("RESULT " + json.dumps(row), flush=True)
        del emitter
        gc.collect()


def flags_of(config: dict) -> tuple[str, ...]:
    from trainer.trial.config import load_config

    return tuple(load_config(config).xla.libtpu_init_args())


def run_group(
    group: list[dict], out: Path, timeout: float, env: dict[str, str], console: Console
) -> list[dict]:
    path = out / f"group_{group[0]['index']}.json"
    path.write_text(json.dumps(group))
    results: dict[int, dict] = {}
    proc = subprocess.Popen(
        [sys.executable, "-m", "benchmarks.space_grid", "--child", str(path)],
        stdout=subprocess.PIPE,
        stderr=(out / f"group_{group[0]['index']}.log").open("w"),
        text=True,
        env=env,
    )
    deadline = time.monotonic() + timeout
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("RESULT "):
            row = json.loads(line.removeprefix("RESULT "))
            results[row["index"]] = row
            figure = row.get("tokens_per_sec_per_chip")
            said = f"{figure:,.0f} tokens/s/chip" if figure else row.get("failure", "")[:100]
            console.print(f"[{time.strftime('%H:%M:%S')}] point {row['index']}: {said}")
        if time.monotonic() > deadline:
            proc.kill()
            break
    code = proc.wait()
    for item in group:
        if item["index"] not in results:
            why = "timed out" if time.monotonic() > deadline else f"its process exited {code}"
            results[item["index"]] = {"index": item["index"], "status": "failed",
                                      "failure": f"crashed: not measured, {why}"}  # fmt: skip
    return [results[item["index"]] for item in group]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("space", nargs="?")
    parser.add_argument("--devices", type=int, default=1, help="devices a trial uses")
    parser.add_argument("--set", dest="sets", action="append", default=[])
    parser.add_argument("--out", default="results/space_grid")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per group")
    parser.add_argument("--only", default="", help="comma-separated point indices")
    parser.add_argument(
        "--budget",
        type=float,
        default=None,
        help="seconds: no point starts after them (the rest: not_run)",
    )
    parser.add_argument(
        "--cache",
        default=None,
        help="convergence references (default DIR/cache; a sweep's results/cache "
        "shares them with its trials)",
    )
    parser.add_argument(
        "--resume",
        action="store_true",
        help="keep the points DIR/grid.csv has measured; measure the rest",
    )
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child)
        return
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    console = Console(width=100)
    rows = configs_of(args.space, args.sets, args.devices, Path(args.cache or out / "cache"))
    for i, row in enumerate(rows):
        row["index"] = i
    wanted = {int(i) for i in args.only.split(",") if i} or set(range(len(rows)))
    measured: dict[int, dict] = {}
    if args.resume and (out / "grid.csv").exists():
        with (out / "grid.csv").open() as f:
            for kept in csv.DictReader(f):
                if kept["status"] not in ("not_run", "invalid"):
                    measured[int(kept["index"])] = _typed(kept)
        wanted -= set(measured)
    runnable = [r for r in rows if "config" in r and r["index"] in wanted]
    groups: dict[tuple[str, ...], list[dict]] = {}
    for row in runnable:
        groups.setdefault(flags_of(row["config"]), []).append(row)
    console.print(f"{args.space}: {len(rows)} points, {len(runnable)} to measure in "
                  f"{len(groups)} process(es) by their LIBTPU flags")  # fmt: skip
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if args.budget:
        env[DEADLINE_ENV] = str(time.time() + args.budget)
    backend = runnable[0]["config"].get("backend") if runnable else None
    if backend == "cpu":  # simulated devices, as a CPU sweep's placement gives its trainers
        env.update(JAX_PLATFORMS="cpu",
                   XLA_FLAGS=f"--xla_force_host_platform_device_count={args.devices}")  # fmt: skip
    for group in groups.values():
        for result in run_group(group, out, args.timeout, env, console):
            measured[result["index"]] = result
    write(rows, measured, out / "grid.csv", console)


def _typed(kept: dict[str, str]) -> dict[str, Any]:
    """A row read back from grid.csv, its figures as numbers."""
    out: dict[str, Any] = dict(kept)
    for key in (*FIGURES, "wall_s", "to_first_step_s"):
        out[key] = float(kept[key]) if kept.get(key) else None
    out["index"] = int(kept["index"])
    return out


def write(rows: list[dict], measured: dict[int, dict], path: Path, console: Console) -> None:
    knob_names = sorted({k for r in rows for k in r["knobs"]})
    fields = [
        "index",
        *knob_names,
        "status",
        "failure",
        *FIGURES,
        "convergence",
        "wall_s",
        "to_first_step_s",
    ]
    table = Table(title=f"{path} (fidelity run, this host's devices)")
    for col in ("#", "knobs", "status", "tokens/s/chip", "mfu", "HBM GiB"):
        table.add_column(col, overflow="fold")
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        for row in rows:
            got = measured.get(row["index"]) or (
                {"status": "invalid", "failure": row["error"]} if "error" in row else {}
            )
            if not got:
                continue
            writer.writerow({"index": row["index"], **row["knobs"],
                             **{k: got.get(k) for k in fields if k in got}})  # fmt: skip
            figure, mfu, hbm = (got.get(k) for k in ("tokens_per_sec_per_chip", "mfu",
                                                      "hbm_per_device_gib"))  # fmt: skip
            table.add_row(
                str(row["index"]),
                " ".join(f"{k.split('.')[-1]}={v}" for k, v in row["knobs"].items()),
                got.get("status", ""),
                f"{figure:,.0f}" if figure else (got.get("failure") or "")[:40],
                f"{mfu:.3f}" if mfu else "-",
                f"{hbm:.1f}" if hbm else "-",
            )
    console.print(table)


if __name__ == "__main__":
    main()
