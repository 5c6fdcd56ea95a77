"""Our trainer against MaxText on the published llama3.1-70b recipes: 8k compiled for
tpu7x:4x4x4, 128k (context parallelism 8) for tpu7x:4x8x8.

    python -m benchmarks.maxtext_parity [--recipe 8k|128k] [--maxtext-python PATH] [--only NAME]
    python -m benchmarks.maxtext_parity --sweeps OURS_ID MAXTEXT_ID [--results-dir DIR]

With --sweeps: the two programs side by side over the points both sweeps compiled (a sweep
of llama31_70b_8k_tpu7x.yaml, our trainer, and one of llama31_70b_8k_maxtext.yaml, MaxText;
`sweeper run ... --set search.warm_start=...` makes both compile the same points): memory
per device (each program's compile) and estimated step time (our step model reading each
program's optimized HLO), point by point.

Each recipe is trial 0 of its space (AI-Hypercomputer/tpu-recipes, training/ironwood):
search_spaces/llama31_70b_8k_tpu7x.yaml (in production 12.20 s/step on 64 chips) and
search_spaces/llama31_70b_128k_tpu7x.yaml (in production on 256 chips). Each row is the
compiler's per-device memory (fidelity compile, libtpu AOT on this host; no TPU). For 8k:

- ours as published (loss untiled, as MaxText's default; AdamW first moment in bf16);
- ours with the loss in 8 vocabulary tiles (`vocab_tiling: 8`);
- ours with a float32 first moment (the trainer's default before `mu_dtype`);
- ours with Splash's query and key layouts seq_minor, as the published file sets them
  (ours as published keeps the trainer space's head_dim_minor);
- MaxText 0.2.5's own `train_compile` of the recipe's file as published (kept under
  tests/data/tpu_recipes/, imported: trial 0 as a MaxText trial of that space is given it),
  when `--maxtext-python` names the Python of a MaxText environment; where that
  environment's JAX or libtpu is not ours (ours pinned 0.10.2 and 0.0.42.1 until
  2026-12-04, MaxText's 0.12.0.1 and 0.0.52, now ours too), ours as published compiled in
  that environment as well, so that one pair differs only in the trainer; without one, the figure recorded on this host kind
  (2026-12-01, with the recipe's Splash flags; the 2026-11-30 figure (docs/facts.md), 0.44 GiB
  less temp, predates them), marked "recorded".

For 128k: ours as published, ours without `dq_reduction_steps` (32 float32 copies of dQ in
the Splash backward), and MaxText's, likewise (recorded: docs/facts.md, 2026-12-02; with this
module's settings MaxText's temp is 75.16 GiB: 2026-12-03 with its former hand-written
arguments, `opt_type=adam_pax`, and 2026-12-04 with the engine's mapping, AdamW with float32
moments, 1,672,032,256 + 80,697,769,984 B; ours in MaxText's JAX 75.53).

A MaxText environment (it needs Python >= 3.12; never a dependency of this project):

    PYENV_VERSION=3.12.1 pyenv exec python -m venv ~/maxtext
    ~/maxtext/bin/pip install 'maxtext[tpu]==0.2.5'
    python -m benchmarks.maxtext_parity --maxtext-python ~/maxtext/bin/python

One compile takes 2-4 minutes on a 2-core host; the table prints when all are done.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from benchmarks.compile_real_models import compile_trial
from benchmarks.tables import compact
from sweeper.space.load import load_space
from sweeper.space.points import assemble
from trainer.maxtext import logs
from trainer.maxtext.driver import maxtext_env, package_dir
from trainer.trial.config import TrialConfig
from trainer.trial.hardware import GIB, Topology
from trainer.trial.maxtext import TRAIN_COMPILE, MaxTextSettings, program_settings

SPACES = Path(__file__).resolve().parents[1] / "search_spaces"


@dataclass(frozen=True)
class Recipe:
    space: Path  # our trainer's: its trial 0 is the recipe
    published: str  # the recipe's file as published (tests/data/tpu_recipes/): MaxText's side
    recorded: dict  # MaxText 0.2.5's train_compile on this host kind (libtpu 0.0.52)
    variants: dict[str, dict]  # our rows: changes to the recipe


RECIPES = {
    "8k": Recipe(
        SPACES / "llama31_70b_8k_tpu7x.yaml",
        "training/ironwood/llama3.1-70b/8k-bf16-tpu7x-4x4x4/xpk/run_recipe.sh",
        # the published file (2026-12-07, jax 0.12.0.1; 86_750_150_656 temp on 2026-12-01 was
        # the hand-written space's, head_dim_minor layouts)
        {"argument": 5_525_434_368, "temp": 86_279_028_736, "compile_s": 193.0},
        {
            "ours: as published": {},
            "ours: Splash layouts seq_minor": {
                "kernels": {"q_layout": "seq_minor", "k_layout": "seq_minor"}
            },
            "ours: vocab_tiling 8": {"vocab_tiling": 8},
            "ours: mu_dtype float32": {"mu_dtype": "float32"},
        },
    ),
    "128k": Recipe(
        SPACES / "llama31_70b_128k_tpu7x.yaml",
        "training/ironwood/llama3.1-70b/128k-bf16-tpu7x-4x8x8/xpk/run_recipe.sh",
        {"argument": 1_672_031_744, "temp": 82_882_297_856, "compile_s": 397.0},  # 2026-12-02
        {
            "ours: as published": {},
            "ours: dq_reduction_steps 0": {"kernels": {"dq_reduction_steps": 0}},
        },
    ),
}


def recipe(name: str = "8k") -> tuple[dict, str]:
    """The recipe's trial config and target, from the space that starts with it."""
    space = load_space(str(RECIPES[name].space))
    return assemble(space, space.search.warm_start[0]), str(space.target)


def changed(trial: dict, change: dict) -> dict:
    """The trial with `change` applied, sections (a dict) merged key by key."""
    out = dict(trial)
    for key, value in change.items():
        merge = isinstance(value, dict) and isinstance(trial.get(key), dict)
        out[key] = {**trial[key], **value} if merge else value
    return out


def maxtext_settings(published: str) -> tuple[MaxTextSettings, str]:
    """The published recipe in MaxText's terms, as a MaxText trial of its imported space's
    trial 0 is given it (`program_settings`: the engine's one mapping, over the file's own
    settings), and its target."""
    from benchmarks.recipe_rows import recipe_trial

    config, knobs, program = recipe_trial(published)
    settings = program_settings(TrialConfig.model_validate(config), program, knobs)
    return settings, config["compile_target"]


def maxtext_compile(python: str, published: str) -> dict:
    """MaxText's train_compile of the published file in its own environment; memory from its
    memory analysis."""
    settings = maxtext_settings(published)[0]
    for unmapped in settings.unmapped:  # e.g. our corpus: MaxText runs its synthetic data
        print(f"not in MaxText's run: {unmapped.field}={unmapped.value} ({unmapped.why})")
    base = package_dir(python) / "configs" / "base.yml"
    env = maxtext_env(
        {
            "LIBTPU_INIT_ARGS": " ".join(settings.libtpu_init_args),
            "JAX_PLATFORMS": "cpu",
            "TPU_WORKER_HOSTNAMES": "localhost",  # no TPU host here: libtpu asks for one
        }
    )
    with tempfile.TemporaryDirectory() as out:
        argv = [str(base), "run_name=parity", f"base_output_directory={out}", *settings.argv()]
        start = time.time()
        proc = subprocess.run(
            [python, "-m", TRAIN_COMPILE, *argv], capture_output=True, text=True, env=env
        )
        wall = time.time() - start
    text = proc.stdout + proc.stderr
    memory = logs.memory_analysis(text)
    if proc.returncode or memory is None:
        raise RuntimeError(f"MaxText train_compile failed (exit {proc.returncode}): {text[-1500:]}")
    return {
        "argument": memory["argument_size_in_bytes"],
        "temp": memory["temp_size_in_bytes"],
        "host_temp": memory.get("host_temp_size_in_bytes", 0),
        "compile_s": wall,
    }


def _row(events: dict, wall: float) -> dict:
    """A table row from a compile trial's events: its memory per device, or its failure."""
    memory = events.get("compiled", {}).get("memory_per_device", {})
    failure = events.get("failure", {})
    return {
        "argument": memory.get("argument_size_in_bytes"),
        "temp": memory.get("temp_size_in_bytes"),
        "compile_s": events.get("compiled", {}).get("compile_s", wall),
        "status": failure.get("failure_class", "ok") if failure or memory else "no events",
    }


def side_by_side(ours: str, theirs: str, results_dir: Path | None) -> Table:
    """Both programs' compile records over the points both sweeps compiled."""
    import pandas as pd

    from sweeper.answer.table import read_frame
    from sweeper.record.manifest import find_sweep
    from sweeper.record.row import knob_columns

    frames = [read_frame(find_sweep(sweep, results_dir).path) for sweep in (ours, theirs)]
    shared = sorted(set(knob_columns(frames[0].columns)) & set(knob_columns(frames[1].columns)))
    only_maxtext = [c for c in knob_columns(frames[1].columns) if c.startswith("knob:maxtext.")]
    key = [c for c in shared if not c.startswith("knob:maxtext.")]
    pairs = pd.merge(
        frames[0].astype({c: str for c in key}),
        frames[1].astype({c: str for c in key}),
        on=key,
        suffixes=(" ours", " maxtext"),
    )
    table = Table(title=f"ours ({ours}) against MaxText ({theirs}): per device, per point")
    for col in ("point", "status ours", "status MaxText", "GiB ours", "GiB MaxText", "memory",
                "est s/step ours", "est s/step MaxText", "step"):  # fmt: skip
        table.add_column(col, justify="right")

    def ratio(a: Any, b: Any) -> str:
        return "-" if pd.isna(a) or pd.isna(b) else f"{a / b - 1:+.1%}"

    def number(value: Any, fmt: str) -> str:
        return "-" if pd.isna(value) else format(value, fmt)

    for _, row in pairs.iterrows():
        point = ", ".join(f"{c.removeprefix('knob:')}={row[c]}" for c in key)
        point += "".join(f", {c.removeprefix('knob:')}={row[c]}" for c in only_maxtext if c in row)
        gib = [row.get(f"hbm_per_device_gib {w}") for w in ("ours", "maxtext")]
        step = [row.get(f"est_step_time_s {w}") for w in ("ours", "maxtext")]
        table.add_row(
            point,
            str(row["status ours"]) + (f" ({row['failure_class ours']})" if row["status ours"] != "ok" else ""),
            str(row["status maxtext"]) + (f" ({row['failure_class maxtext']})" if row["status maxtext"] != "ok" else ""),
            number(gib[0], ".2f"), number(gib[1], ".2f"), ratio(gib[0], gib[1]),
            number(step[0], ".2f"), number(step[1], ".2f"), ratio(step[0], step[1]),
        )  # fmt: skip
    return table


def compiler_of(python: str) -> str:
    """The JAX and libtpu of `python`'s environment."""
    code = 'from importlib.metadata import version as v; print(f\'jax {v("jax")}, libtpu {v("libtpu")}\')'
    return subprocess.run(
        [python, "-c", code], capture_output=True, text=True, check=True
    ).stdout.strip()


def memory_table(name: str, target: str, rows: list[tuple[str, str, dict]]) -> Table:
    """HBM per device of each row (who, which compile, its memory record) against MaxText's
    (the row named MaxText, else the recipe's recorded compile): 80 columns."""
    reference = next((r for n, _, r in rows if n.startswith("MaxText")), RECIPES[name].recorded)
    ref_total = reference["argument"] + reference["temp"]
    usable = Topology.parse(target).accelerator.usable_hbm_per_device
    table = compact(
        f"llama3.1-70b {name} recipe on {target}: HBM per device, GiB (usable "
        f"{usable / GIB:.2f}; fidelity compile, TPU7x)",
        "figure: compiled by this run, or MaxText's compile as recorded; s: its compile seconds",
    )
    for col in ("who", "figure", "arguments", "temp", "total", "vs MaxText", "fits", "s"):
        table.add_column(
            col,
            justify="left" if col == "who" else "right",
            no_wrap=col != "who",
            min_width=20 if col == "who" else None,
        )
    for who, compiled, row in rows:
        figure = compiled.removeprefix("compile (").removesuffix(")")
        if row.get("argument") is None:
            table.add_row(who, figure, "-", "-", "-", "-", row.get("status", "-"), "-")
            continue
        total = row["argument"] + row["temp"]
        table.add_row(
            who,
            figure,
            f"{row['argument'] / GIB:.2f}",
            f"{row['temp'] / GIB:.2f}",
            f"{total / GIB:.2f}",
            f"{total / ref_total - 1:+.1%}",
            "yes" if total <= usable else "no",
            f"{row['compile_s']:.0f}",
        )
    return table


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--recipe", choices=list(RECIPES), default="8k", help="which recipe")
    parser.add_argument("--maxtext-python", help="the Python of a MaxText 0.2.5 environment")
    parser.add_argument("--only", help="one row (a variant name), skipping MaxText")
    parser.add_argument(
        "--sweeps", nargs=2, metavar=("OURS", "MAXTEXT"), help="two sweeps' compile records"
    )
    parser.add_argument("--results-dir", type=Path, help="where the sweeps are (default results/)")
    args = parser.parse_args()
    if args.sweeps:
        ours, theirs = args.sweeps
        Console(width=220).print(side_by_side(ours, theirs, args.results_dir))
        return
    chosen = RECIPES[args.recipe]
    trial, target = recipe(args.recipe)
    rows: list[tuple[str, str, dict]] = []
    for name, change in chosen.variants.items():
        if args.only and args.only != name:
            continue
        rows.append(
            (name, "compile (this run)", _row(*compile_trial(changed(trial, change), target)))
        )
    if not args.only:
        if args.maxtext_python:
            ours_compiler, theirs_compiler = (
                compiler_of(sys.executable),
                compiler_of(args.maxtext_python),
            )
            print(f"compiler: ours {ours_compiler}; MaxText's {theirs_compiler}")
            if ours_compiler != theirs_compiler:  # ours again under MaxText's compiler
                same = compile_trial(trial, target, python=args.maxtext_python)
                rows.append(
                    ("ours: as published, MaxText's JAX", "compile (this run)", _row(*same))
                )
            theirs = maxtext_compile(args.maxtext_python, chosen.published)
            rows.append(("MaxText 0.2.5", "compile (this run)", theirs))
        else:
            rows.append(("MaxText 0.2.5", "compile (recorded)", chosen.recorded))
    Console().print(memory_table(args.recipe, target, rows))


if __name__ == "__main__":
    main()
