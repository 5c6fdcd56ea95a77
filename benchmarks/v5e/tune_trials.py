"""`kernels.tune` on the lent v5e: trial 0 of a v5e space run three ways, each in a trial's
own process (`python -m trainer`, its LIBTPU flags set as a sweep's trial's are): its own
tiles (tune off), the tiles tune-jax times fastest on the chip (tune time), and the tiles the
compile-fidelity tuner prices lowest for v5e:1x1 (tune compile, run on a CPU host
beforehand: `python -m benchmarks.v5e.tune_trials priced SPACE` writes
benchmarks/data/SPACE_compile_tuned.json). v5e_dense tunes Splash's blocks; v5e_moe's trial 0
runs its experts through Megablox (`POINTS`), so its grouped matmul's tiles are tuned too.

    python -m benchmarks.v5e.tune_trials priced [SPACE]        # on a CPU host with libtpu
    python -m benchmarks.v5e.tune_trials run OUT_DIR [SPACE]   # on the chip: OUT_DIR/tune.json
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

DATA = Path(__file__).resolve().parents[1] / "data"
# A space's trial 0 as tuned here: its first point, these knobs changed (ragged_dot takes no
# tiles; Megablox's grouped matmul does).
POINTS: dict[str, dict[str, Any]] = {"v5e_dense": {}, "v5e_moe": {"kernels.moe_gmm": "megablox"}}


def priced_path(space_name: str) -> Path:
    return DATA / f"{space_name}_compile_tuned.json"


def trial0(tune: str, space_name: str = "v5e_dense", **kernels: Any) -> dict[str, Any]:
    """Trial 0 of a v5e space on one device, with `kernels.tune` and any tiles given."""
    from sweeper.space.checks import static_check
    from sweeper.space.load import load_space
    from sweeper.space.points import first_point

    space = load_space(space_name)
    config = static_check(space, {**first_point(space), **POINTS[space_name]}, 1)
    update = {"tune": tune, **kernels}
    config = config.model_copy(update={"kernels": config.kernels.model_copy(update=update),
                                       "num_devices": 1, "backend": "tpu"})  # fmt: skip
    return config.model_dump(mode="json")


def events(config: dict[str, Any], folder: Path, name: str, args: list[str]) -> list[dict]:
    path = folder / f"{name}.json"
    path.write_text(json.dumps(config))
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "trainer", "--config", str(path), *args],
                          capture_output=True, text=True)  # fmt: skip
    (folder / f"{name}.log").write_text(done.stdout + done.stderr)
    out = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    out.append({"event": "wall", "seconds": time.perf_counter() - start, "code": done.returncode})
    return out


def priced(space_name: str) -> None:
    """The compile tuner's choice for trial 0, compiled for v5e:1x1 on this host."""
    folder = Path(f"results/{space_name}_tune_priced")
    folder.mkdir(parents=True, exist_ok=True)
    got = events(
        trial0("compile", space_name), folder, "priced", ["--compile-only", "--target", "v5e:1x1"]
    )
    compiled = next(e for e in got if e["event"] in ("compiled", "failure"))
    from trainer.compile.tiles.record import Tuning

    tuning = compiled.get("kernel_tuning")
    if not tuning:
        raise SystemExit(f"no tuning in the compile trial: {compiled}")
    chosen = Tuning.from_json(tuning, cached=False).settings()
    priced_path(space_name).write_text(
        json.dumps({"chosen": chosen, "tuning": tuning}, indent=1) + "\n"
    )
    print(json.dumps(chosen))


def run(folder: Path, space_name: str) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    ways = {"own": trial0("off", space_name), "timed": trial0("time", space_name)}
    priced_file = priced_path(space_name)
    if priced_file.exists():
        chosen = json.loads(priced_file.read_text())["chosen"]
        ways["priced"] = trial0("off", space_name, **chosen)
    else:
        print(f"no {priced_file.name}: the compile tuner's choice is not run", flush=True)
    rows = []
    for name, config in ways.items():
        got = events(config, folder, name, [])
        summary = next((e for e in got if e["event"] == "summary"), {})
        compiled = next((e for e in got if e["event"] == "compiled"), {})
        failure = next((e for e in got if e["event"] == "failure"), {})
        ran = dict(config["kernels"])
        if compiled.get("kernel_tuning"):  # tune time: the blocks it timed fastest ran
            from trainer.compile.tiles.record import Tuning

            ran.update(Tuning.from_json(compiled["kernel_tuning"], cached=False).settings())
        row = {"way": name, "tokens_per_sec_per_chip": summary.get("tokens_per_sec_per_chip"),
               "low": summary.get("tokens_per_sec_per_chip_low"),
               "high": summary.get("tokens_per_sec_per_chip_high"),
               "blocks": {k: v for k, v in ran.items() if k.startswith(("block_", "gmm_t"))},
               "tuning": compiled.get("kernel_tuning"), "effects": compiled.get("effects"),
               "failure": failure.get("message", "")[:300],
               "wall_s": got[-1]["seconds"]}  # fmt: skip
        rows.append(row)
        print(json.dumps(row)[:1500], flush=True)
        (folder / "tune.json").write_text(json.dumps(rows, indent=1))  # kept if a later one dies


if __name__ == "__main__":
    if sys.argv[1] == "priced":
        priced(sys.argv[2] if len(sys.argv) > 2 else "v5e_dense")
    else:
        run(Path(sys.argv[2]), sys.argv[3] if len(sys.argv) > 3 else "v5e_dense")
