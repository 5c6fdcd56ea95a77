"""The step-time model (trainer/compile/step_model.py) against the published Ironwood results.

    python -m benchmarks.calibration [--recompile | --recorded | --freeze ROW]

Rows: the public table of AI-Hypercomputer/tpu-recipes, training/ironwood/README.md,
for the models our presets cover, each compiled by libtpu on this host with the recipe's
knobs (trial 0 of its space in search_spaces/; fp8 rows: the same with precision fp8), at
full depth: the layers are one scanned loop, so depth costs no compile time, and the HLO
walk multiplies the loop body by its trip count. A 64-chip compile takes 10-25 minutes on
a 2-core host, a 256-chip one longer. Compile records (the program's counted cost) are
kept in results/calibration/ (`--recompile` redoes them; `--recorded` tables the rows
compiled so far).

`MXU_EFFICIENCY` (bf16) and `FP8_MXU_EFFICIENCY` are fitted on the FIT rows only (what
collectives and transfers hide is not fitted: the model runs the program's schedule); they
price XLA's own matmuls, the Mosaic kernels running at their families' efficiencies fitted on
tokamax's TPU7x timings (benchmarks/kernel_reference.py), on no row here. Every
other row is split by what the model could have seen: `blind` when its prediction for this
compiler's program was committed (benchmarks/data/frozen_predictions.json) before its
published figure entered this file, read from git's history; `seen` otherwise (the figure
was in the repository, on screen, while the model or the prediction was made). The published
rows read on MaxText's own program (`MAXTEXT`: the program the published run ran; the
llama3.1-70b 64-chip rows and the MoE rows) are counted apart. Rows whose per-device program is a fit row's (the same recipe on more chips)
are named in the last column: they test little.

The frozen-prediction rule: a row not yet compared is listed in PENDING, without its
published figure; `--freeze ROW` compiles it, predicts it with the committed model and
writes the prediction with that commit to benchmarks/data/frozen_predictions.json; that file
is committed before the row moves to PUBLISHED with its figure, in a later commit.
Fidelity: estimate (from compiles), against a published run.
"""

from __future__ import annotations

import argparse
import datetime
import gzip
import io
import itertools
import json
import statistics
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path
from typing import Any

from rich.console import Console

from benchmarks.tables import compact
from sweeper.space.load import load_space
from sweeper.space.points import assemble
from trainer.compile.cost import program_cost
from trainer.compile.schedule import Schedule
from trainer.compile.step_model import KernelFlops, kernel_flops, step_time
from trainer.trial.config import load_config
from trainer.trial.hardware import ACCELERATORS, Topology

RECORDS = Path(__file__).resolve().parents[1] / "results" / "calibration"
# The table as of AI-Hypercomputer/tpu-recipes@39ff447 (training/ironwood/README.md), whose
# fp8 rows ran the bf16 recipe with fp8_full. Its later version (@0797d9c) lists faster fp8
# rows from re-tuned recipes (8k-fp8-tpu7x-4x4x4: other Splash blocks, fixed fp8 scaling):
# the "re-tuned" row, with that recipe's knobs.
# name: (space, precision, target, published step s, published tokens/s/chip)
PUBLISHED = {
    "llama3.1-70b 8k bf16 64 chips": ("llama31_70b_8k_tpu7x", "bf16", "tpu7x:4x4x4", 12.20, 2686.98),
    "llama3.1-70b 8k fp8 64 chips": ("llama31_70b_8k_tpu7x", "fp8", "tpu7x:4x4x4", 8.38, 3911.90),
    "llama3.1-70b 8k bf16 256 chips": ("llama31_70b_8k_tpu7x", "bf16", "tpu7x:4x8x8", 12.27, 2670.55),
    "llama3.1-70b 8k fp8 256 chips": ("llama31_70b_8k_tpu7x", "fp8", "tpu7x:4x8x8", 8.39, 3904.80),
    "llama3.1-70b 8k fp8 re-tuned 64 chips": ("llama31_70b_8k_tpu7x", "fp8", "tpu7x:4x4x4", 7.93, 4127.56),
    "llama3.1-405b 8k bf16 256 chips": ("llama31_405b_8k_tpu7x", "bf16", "tpu7x:4x8x8", 101.89, 482.41),
    "llama3.1-405b 8k fp8 256 chips": ("llama31_405b_8k_tpu7x", "fp8", "tpu7x:4x8x8", 64.71, 759.55),
    "qwen3-235b-a22b 4k bf16 256 chips": ("qwen3_235b_4k_tpu7x", "bf16", "tpu7x:4x8x8", 31.58, 4150.78),
    # fp8 experts inside tokamax's grouped matmuls (trainer/model/fp8_gmm.py), as the recipe runs them.
    "qwen3-235b-a22b 4k fp8 256 chips": ("qwen3_235b_4k_tpu7x", "fp8", "tpu7x:4x8x8", 27.67, 4736.72),
    # @0797d9c, entered after its prediction was frozen (6f6a264).
    "llama3.1-70b 8k fp8 re-tuned 256 chips": ("llama31_70b_8k_tpu7x", "fp8", "tpu7x:4x8x8", 7.95, 4121.02),
}  # fmt: skip
# The published rows read again on the program they ran: MaxText's own (the rows above
# compile ours; the llama3.1-70b 64-chip rows the fit's, on another program here), compiled by
# MaxText 0.2.5's train_compile (its libtpu) from the recipe's file as published, kept under
# tests/data/tpu_recipes/ (`sweeper import` of it: trial 0; `--recompile --only NAME`
# compiles one again; needs `make maxtext`). A split of their own: another program, another
# compiler than the fit rows'.
# name: (kept file, target, published step s, published tokens/s/chip). The figures are
# those the table at the kept files' commit (c8cfe2f: benchmarks/data/published/) gives each
# file: its llama3.1-70b fp8 file is the re-tuned recipe (Splash 1024/1024/512 forward),
# 4,127.56 there, where the 39ff447 table's 3,911.90 was the earlier fp8 file's; its qwen3
# bf16 row reads 30.87 s, 4,245.89, where 39ff447's read 31.58 s, 4,150.78.
MAXTEXT = {
    "llama3.1-70b 8k bf16 64 chips on MaxText": ("training/ironwood/llama3.1-70b/8k-bf16-tpu7x-4x4x4/xpk/run_recipe.sh", "tpu7x:4x4x4", 12.20, 2686.98),
    "llama3.1-70b 8k fp8 re-tuned 64 chips on MaxText": ("training/ironwood/llama3.1-70b/8k-fp8-tpu7x-4x4x4/xpk/run_recipe.sh", "tpu7x:4x4x4", 7.93, 4127.56),
    "qwen3-235b-a22b 4k bf16 256 chips on MaxText": ("training/ironwood/qwen3-235b-a22b/4k-bf16-tpu7x-4x8x8/xpk/run_recipe.sh", "tpu7x:4x8x8", 30.87, 4245.89),
    "qwen3-235b-a22b 4k fp8 256 chips on MaxText": ("training/ironwood/qwen3-235b-a22b/4k-fp8-tpu7x-4x8x8/run_recipe.sh", "tpu7x:4x8x8", 27.67, 4736.72),
}  # fmt: skip
# Rows whose published figure is not entered until the model's prediction for them is frozen
# (`--freeze`, committed with the commit that made it): name: (space, precision, target).
# A row moves to PUBLISHED once its frozen prediction is committed.
PENDING: dict[str, tuple[str, str, str]] = {}
# Where a row's recipe differs from trial 0 of its space (beyond precision): its own knobs.
# Splash layouts, the fused backward kernel and the splash scheduler have no knob here.
_BLOCKS = ("block_q", "block_kv", "block_kv_compute", "block_q_dkv", "block_kv_dkv", "block_kv_dkv_compute")  # fmt: skip
OVERRIDES = {
    "llama3.1-70b 8k fp8 re-tuned 64 chips": {
        "kernels": dict(zip(_BLOCKS, (1024, 1024, 512, 2048, 2048, 256), strict=True)),
        "precision": {"scaling": "fixed", "fixed_bound": 224.0},
        "xla": {"extra": ["--xla_tpu_enable_offloading_copy_to_sparsecore=false",
                          "--xla_tpu_enable_sparse_core_collective_offload_nd_reduce_scatter=false"]},
    },
    "llama3.1-70b 8k fp8 re-tuned 256 chips": {
        "kernels": dict(zip(_BLOCKS, (1024, 1024, 512, 2048, 2048, 256), strict=True)),
        "precision": {"scaling": "fixed", "fixed_bound": 224.0},
    },
    # 4k-fp8-tpu7x-4x8x8: fixed scales (fp8_full through qwix: scales per axis); no DVFS
    # flag. Its grouped-matmul tiles reach no kernel in MaxText's tokamax path (they pad rows).
    "qwen3-235b-a22b 4k fp8 256 chips": {
        "precision": {"granularity": "per_axis", "scaling": "fixed", "fixed_bound": 224.0},
        "xla": {"drop": ["--xla_tpu_dvfs_p_state=3"], "extra": []},
    },
    "llama3.1-405b 8k fp8 256 chips": {  # 8k-fp8-tpu7x-4x8x8: only the layer input offloaded
        "remat": {"policy": "custom", "custom": {"decoder_layer_input": "offload"}},
        "kernels": {**dict(zip(_BLOCKS, (1024, 2048, 256, 2048, 2048, 1024), strict=True)), "max_logit_const": 30.0},
    },
}  # fmt: skip
FIT = ("llama3.1-70b 8k bf16 64 chips", "llama3.1-70b 8k fp8 64 chips")


def recipe(name: str) -> tuple[dict, str]:
    space_name, precision, target = (PUBLISHED.get(name) or PENDING[name])[:3]
    space = load_space(f"spaces/{space_name}.yaml")
    config = assemble(space, space.search.warm_start[0])
    config["precision"] = {**config.get("precision", {}), "mode": precision}
    for section, values in OVERRIDES.get(name, {}).items():
        if section == "xla":  # the recipe's flags join the space's (less those it lacks)
            kept = [f for f in config["xla"].get("extra", []) if f not in values.get("drop", ())]
            extra = [*kept, *values["extra"]]
            config["xla"] = {**config["xla"], "extra": extra}
        else:  # a section's keys replace the space's (remat: its policy and placements)
            config[section] = {**config.get(section, {}), **values}
    # The rows were compiled with the loss in 8 tiles, when the 70B recipe untiled was 0.3 GiB
    # over a device (it fits since the unembedding gather waits for the decoder loop:
    # benchmarks.maxtext_parity). Tiled, one more unembedding matmul a step (about 0.3%).
    config["vocab_tiling"] = 8
    return config, target


def compile_row(name: str) -> None:
    """In this process (a child: libtpu reads its flags once): compile the row's program and
    keep its optimized HLO (gzipped) and memory, so its cost can be recounted as
    trainer/compile/cost.py improves, without compiling again."""
    config, target = recipe(name)
    trial = load_config({**config, "compile_target": target})
    from trainer.cli import prepare_environment

    prepare_environment(trial)  # the trial's LIBTPU flags, before libtpu starts
    from trainer.compile.aot import topology_devices
    from trainer.program.build import build_program, compile_step, memory_per_device

    compiled, compile_s = compile_step(build_program(trial, topology_devices(target)))
    RECORDS.mkdir(parents=True, exist_ok=True)
    hlo_path(name).write_bytes(gzip.compress(compiled.as_text().encode()))
    memory = memory_per_device(compiled)
    record = {"memory_per_device": memory, "compile_s": compile_s, "target": target,
              "compiler": compiler()}  # fmt: skip
    record_path(name).write_text(json.dumps(record, indent=1))


def maxtext_recipe(name: str) -> tuple[dict, dict, Any]:
    """A MaxText row's trial (as our trainer's config, which the step model's kernel count
    reads), its maxtext.* knobs, and its space's MaxText program."""
    from benchmarks.recipe_rows import recipe_trial

    path, target = MAXTEXT[name][:2]
    config, knobs, program = recipe_trial(path)
    assert config["compile_target"] == target, f"{path} runs on {config['compile_target']}"
    return config, knobs, program


def compile_maxtext_row(name: str) -> None:
    """MaxText's train_compile of the row (through the engine's MaxText driver), its optimized
    HLO and memory kept as for our rows, with the JAX and libtpu of MaxText's environment."""
    from trainer.maxtext.driver import compile_trial
    from trainer.trial.events import Emitter

    config, knobs, program = maxtext_recipe(name)
    RECORDS.mkdir(parents=True, exist_ok=True)
    summary = compile_trial(load_config(config), program, knobs, Emitter(stream=io.StringIO()),
                            keep_hlo=hlo_path(name))  # fmt: skip
    versions = subprocess.run(
        [program.interpreter(), "-c", "from importlib.metadata import version as v; "
         "print(v('jax'), v('libtpu'), v('maxtext'))"],
        capture_output=True, text=True, check=True,
    ).stdout.split()  # fmt: skip
    record = {"memory_per_device": summary["memory_per_device"], "compile_s": summary["compile_s"],
              "target": config["compile_target"], "program": f"MaxText {versions[2]}",
              "compiler": {"jax": versions[0], "libtpu": versions[1]}}  # fmt: skip
    record_path(name).write_text(json.dumps(record, indent=1))


def compiled_cost(name: str, recompile: bool) -> dict:
    """The row's program cost, counted from its kept HLO (compiled first if there is none)."""
    if recompile or not hlo_path(name).exists():
        start = time.time()
        if name in MAXTEXT:
            compile_maxtext_row(name)  # MaxText runs in its own process already
        else:
            command = [sys.executable, "-m", "benchmarks.calibration", "--compile-row", name]
            proc = subprocess.run(command, capture_output=True, text=True)
            if proc.returncode:
                raise SystemExit(f"{name} did not compile: {proc.stderr[-1500:]}")
        print(f"compiled {name} in {time.time() - start:.0f} s", flush=True)  # minutes each
    return program_cost(gzip.decompress(hlo_path(name).read_bytes()).decode())


def compiler() -> dict[str, str]:
    """The JAX and libtpu installed here: what compiles a row now."""
    return {"jax": metadata.version("jax"), "libtpu": metadata.version("libtpu")}


def compiled_by(name: str) -> dict[str, str]:
    """The JAX and libtpu that compiled the row's kept record."""
    return json.loads(record_path(name).read_text()).get("compiler", {})


def hlo_path(name: str) -> Path:
    return record_path(name).with_suffix(".hlo.gz")


def record_path(name: str) -> Path:
    return RECORDS / f"{name.replace(' ', '_')}.json"


def estimate_rows(
    recompile: bool, only: str | None = None, recorded: bool = False, pending: bool = False
) -> dict[str, dict]:
    """The rows' counted programs (fit rows always). `pending`: PENDING rows too, with no
    published figure (for `freeze`); a table never shows them."""
    listed: dict[str, tuple] = {n: (*row[:3], row[3], row[4]) for n, row in PUBLISHED.items()}
    if pending:
        listed |= {n: (*row, None, None) for n, row in PENDING.items()}
    listed |= {n: (row[0], None, *row[1:]) for n, row in MAXTEXT.items()}
    rows = {}
    for name, (_, _, target, step, tokens) in listed.items():
        if only and only not in name and name not in FIT:
            continue
        if recorded and not hlo_path(name).exists():
            print(f"{name}: not compiled yet (no record), left out", flush=True)
            continue
        config = maxtext_recipe(name)[0] if name in MAXTEXT else recipe(name)[0]
        trial = load_config({**config, "compile_target": target})
        devices = Topology.parse(target).devices
        global_batch = round(trial.per_device_batch * devices)
        cost = compiled_cost(name, recompile)
        # Read once: the fit runs each row's schedule thousands of times.
        cost["schedule"] = Schedule.model_validate(cost["schedule"])
        calls, width = cost.get("kernel_calls"), ACCELERATORS["tpu7x"].mxu_width
        rows[name] = {
            "cost": cost,
            "kernels": kernel_flops(trial, global_batch, devices, calls=calls, mxu_width=width),
            "tokens_per_step": global_batch * trial.seq_len,
            "chips": Topology.parse(target).chips,
            "published_step_s": step,
            "published_tokens": tokens,
        }
    return rows


# (bf16 MXU efficiency, fp8 MXU efficiency): the datasheet's peaks for XLA's own matmuls
# (the Mosaic kernels keep their families' efficiencies, measured on tokamax's timings).
UNCALIBRATED = (1.0, 1.0)


def predict(row: dict, constants: tuple[float, float]) -> float:
    mxu, fp8 = constants
    accel = ACCELERATORS["tpu7x"]
    step = step_time(row["cost"], accel, row["kernels"], mxu, fp8)
    return row["tokens_per_step"] / step["est_step_time_s"] / row["chips"]


def error(row: dict, constants: tuple[float, float]) -> float:
    return predict(row, constants) / row["published_tokens"] - 1


def fit(rows: dict[str, dict]) -> tuple[float, float]:
    grid = [x / 100 for x in range(20, 101)]
    return min(
        itertools.product(grid, grid),
        key=lambda c: statistics.median(abs(error(rows[n], c)) for n in FIT),
    )


# Predictions committed before their rows were compared. A compared row without one was
# compared before the rule (2026-12-03): structural rules were added while its error was on
# screen, so its held-out error is an optimistic figure.
FROZEN = Path(__file__).resolve().parent / "data" / "frozen_predictions.json"


def frozen() -> dict[str, dict]:
    return json.loads(FROZEN.read_text()) if FROZEN.exists() else {}


# The compiler of every prediction frozen before predictions named theirs (2026-12-04).
FIRST_COMPILER = "0.0.42.1"


def frozen_key(name: str, libtpu: str) -> str:
    """Where a row's prediction for the program `libtpu` compiled is frozen: a new compiler
    makes a new program, so its prediction is frozen anew beside the old one, never over it."""
    return name if libtpu == FIRST_COMPILER else f"{name} | libtpu {libtpu}"


REPO = Path(__file__).resolve().parents[1]  # whose commit a frozen prediction names


def git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True).stdout.strip()


def freeze(name: str) -> None:
    """Commit to a prediction for a row before its published figure is compared: the row's
    program (compiled if it has no record), the constants fitted on FIT, the estimate, and
    the commit of the code that made it. Refused for a row already frozen, and while the
    model's code has uncommitted changes (the commit would not be what predicted)."""
    if name not in PUBLISHED and name not in PENDING:
        raise SystemExit(f"no row named {name!r} (PUBLISHED or PENDING in {__file__})")
    dirty = git("status", "--porcelain", "trainer", "benchmarks/calibration.py")
    if dirty:
        raise SystemExit(f"commit the model first; uncommitted:\n{dirty}")
    rows = estimate_rows(recompile=False, only=name, recorded=False, pending=True)
    made_by = compiled_by(name)
    key, predictions = frozen_key(name, made_by.get("libtpu", "?")), frozen()
    if key in predictions:
        raise SystemExit(f"{key} was frozen at {predictions[key]['commit']}; a frozen "
                         "prediction is never replaced")  # fmt: skip
    constants = fit(rows)
    row = rows[name]
    predicted = predict(row, constants)
    predictions[key] = {
        "compiler": made_by,
        "tokens_per_sec_per_chip": round(predicted, 2),
        "step_s": round(row["tokens_per_step"] / row["chips"] / predicted, 3),
        "constants": list(constants),
        "commit": git("rev-parse", "HEAD"),
        "frozen_at": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "fidelity": "estimate (from a libtpu compile for the row's target)",
    }
    FROZEN.parent.mkdir(parents=True, exist_ok=True)
    FROZEN.write_text(json.dumps(predictions, indent=1, sort_keys=True) + "\n")
    print(f"{key}: {predicted:,.0f} tokens/s/chip predicted (frozen in {FROZEN.name}; "
          "commit it before entering the published figure)")  # fmt: skip


def _signature(cost: dict, kernels: KernelFlops) -> tuple[float, ...]:
    """What makes two rows' per-device programs the same for the model: FLOPs by precision,
    collective bytes and kernel FLOPs. HBM bytes are left out: the same recipe on 4x the
    chips holds a quarter of the parameter and optimizer shards, so its update reads fewer
    bytes (0.6% of the 70B step's HBM bytes), with every matmul and collective unchanged."""
    flops = cost["flops"]
    collectives = sum(op["bytes"] for op in cost["collective_ops"])
    return (*(flops.get(p, 0.0) for p in ("bf16", "fp8", "f32")), collectives, kernels.total)


def same_program(name: str, rows: dict[str, dict]) -> list[str]:
    """The other rows whose per-device program is this row's (`_signature` within 0.5%)."""
    mine = _signature(rows[name]["cost"], rows[name]["kernels"])
    return [
        other
        for other in rows
        if other != name
        and all(abs(a - b) <= 0.005 * max(abs(a), abs(b), 1.0) for a, b in
                zip(mine, _signature(rows[other]["cost"], rows[other]["kernels"]), strict=True))
    ]  # fmt: skip


def first_commit(text: str, path: str) -> str | None:
    """The first commit whose change to `path` added `text` (git's pickaxe), or None."""
    found = git("log", "--reverse", "--format=%H", "-S", text, "--", path).split()
    return found[0] if found else None


def figure_commit(name: str) -> str | None:
    """The commit that entered a row's published figure into this file."""
    published = PUBLISHED.get(name) or MAXTEXT.get(name)
    if published is None:
        return None
    return first_commit(repr(published[-1]), "benchmarks/calibration.py")


def blind(name: str, key: str) -> bool:
    """Whether the prediction frozen under `key` was committed (frozen_predictions.json)
    before the row's published figure entered the repository: only then was it made without
    the figure in sight."""
    frozen_in = first_commit(json.dumps(key), f"benchmarks/data/{FROZEN.name}")
    entered = figure_commit(name)
    if frozen_in is None or entered is None or frozen_in == entered:
        return False
    return subprocess.run(["git", "merge-base", "--is-ancestor", frozen_in, entered],
                          cwd=REPO).returncode == 0  # fmt: skip


def split(name: str, key: str) -> str:
    """fit (the constants' rows); blind (its prediction for this compiler's program was
    committed before its published figure entered the repository); seen (every other row:
    its figure was in the repository, on screen, when the model or its prediction was made).
    The published rows read on MaxText's own program are seen too, and counted apart."""
    if name in FIT:
        return "fit"
    if name in MAXTEXT:
        return "seen, MaxText's program"
    return "blind" if blind(name, key) else "seen"


SPLITS = ("fit", "seen", "blind", "seen, MaxText's program")


def _print_blind_predictions(console: Console, rows: dict[str, dict]) -> None:
    """Every frozen prediction, of any compiler's program, made before its row's figure
    entered the repository: the only errors that test the model on rows it never saw."""
    said = []
    for key, pinned in sorted(frozen().items()):
        name = key.split(" | ")[0]
        if name not in rows or not blind(name, key):
            continue
        published = rows[name]["published_tokens"]
        compiled = pinned.get("compiler", {}).get("libtpu", FIRST_COMPILER)
        said.append(f"{name} (libtpu {compiled}, model at {pinned['commit'][:7]}): "
                    f"{pinned['tokens_per_sec_per_chip']:,.0f} vs {published:,.0f}, "
                    f"{pinned['tokens_per_sec_per_chip'] / published - 1:+.1%}")  # fmt: skip
    console.print(f"blind predictions (committed before the row's figure), any compiler: "
                  f"{len(said)}" + "".join(f"\n  {line}" for line in said))  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--recompile", action="store_true")
    parser.add_argument("--only", help="held-out rows whose name contains this (fit rows always)")
    parser.add_argument("--recorded", action="store_true", help="only rows compiled before")
    parser.add_argument("--freeze", metavar="ROW", help="commit to a prediction for ROW first")
    parser.add_argument("--compile-row", help=argparse.SUPPRESS)  # the child that compiles
    args = parser.parse_args()
    if args.compile_row:
        return compile_row(args.compile_row)
    if args.freeze:
        return freeze(args.freeze)
    rows = estimate_rows(args.recompile, args.only, args.recorded)
    if not all(name in rows for name in FIT):
        raise SystemExit(f"the fit rows {FIT} need compile records first")
    fitted = fit(rows)
    predictions = frozen()
    table = compact(f"tokens/s/chip, estimated vs published (fidelity compile, TPU7x; fit on "
                    f"{len(FIT)} rows: MXU efficiency bf16 {fitted[0]:.2f}, fp8 "
                    f"{fitted[1]:.2f})", "raw: at the step model's own MXU efficiencies; est.: "
                    "at the fitted ones; frozen: the prediction committed before the row's "
                    "figure (its error, its commit)")  # fmt: skip
    for column in ("row", "split", "published", "raw", "est.", "error", "frozen"):
        table.add_column(column, justify="left" if column in ("row", "split", "frozen") else
                         "right", no_wrap=column not in ("row", "split"),
                         min_width={"row": 20, "frozen": 13}.get(column),
                         max_width=10 if column == "split" else None)  # fmt: skip
    made_by = {name: compiled_by(name).get("libtpu", "?") for name in rows}  # read once
    keys = {n: frozen_key(n, made_by[n]) for n in rows}
    pinned_for = {n: predictions.get(keys[n]) for n in rows}
    splits = {n: split(n, keys[n]) for n in rows}
    for name, row in rows.items():
        pinned = pinned_for[name]
        before = (f"{pinned['tokens_per_sec_per_chip'] / row['published_tokens'] - 1:+.1%} "
                  f"{pinned['commit'][:7]}" if pinned else "none")  # fmt: skip
        table.add_row(name, splits[name], f"{row['published_tokens']:,.0f}",
                      f"{predict(row, UNCALIBRATED):,.0f}", f"{predict(row, fitted):,.0f}",
                      f"{error(row, fitted):+.1%}", before)  # fmt: skip
    console = Console()
    console.print(table)
    same = {n: same_program(n, rows) for n in rows}  # each row's twins, read once
    twins = sorted({tuple(sorted((n, *others))) for n, others in same.items() if others})
    for twin in twins:
        console.print("same per-device program: " + "; ".join(twin))
    installed = compiler()["libtpu"]
    older = [n for n in rows if made_by[n] != installed]
    console.print(f"compiler: libtpu {installed} installed, every row's "
                  f"{', '.join(sorted(set(made_by.values())))}; the fit rows compiled by "
                  f"{', '.join(sorted({made_by[n] for n in FIT}))}"
                  + (f"; {len(older)} rows by another (`--recompile --only NAME` redoes one)"
                     if older else ""))  # fmt: skip
    for name in SPLITS:
        errors = [abs(error(rows[n], fitted)) for n in rows if splits[n] == name]
        if not errors:
            console.print(f"median absolute error, {name}: no rows")
            continue
        console.print(f"median absolute error, {name}: {statistics.median(errors):.1%} "
                      f"over {len(errors)} rows")  # fmt: skip
    _print_blind_predictions(console, rows)
    pairs = [(n, n.replace("bf16", kind), kind) for n in rows if "bf16" in n
             for kind in ("fp8", "fp8 re-tuned")]  # fmt: skip
    for bf16, fp8, kind in pairs:
        if fp8 not in rows:
            continue
        ours = predict(rows[fp8], fitted) / predict(rows[bf16], fitted)
        published = rows[fp8]["published_tokens"] / rows[bf16]["published_tokens"]
        ok = 1 < ours <= published + 0.15
        console.print(f"{kind}/bf16 {bf16.replace(' bf16', '')}: ours {ours:.2f}x, published {published:.2f}x "
                      f"({'ordered right' if ok else 'WRONG'})")  # fmt: skip


if __name__ == "__main__":
    main()
