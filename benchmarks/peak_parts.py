"""What a kept recipe's compiled program holds at its memory peak, by part: MaxText 0.2.5's
train_compile of the recipe's trial 0 for its TPU7x topology on this CPU host, with XLA's
dump, read from the dump's live ranges (`*-live-range.txt`, its peak's stack trace
breakdown). Fidelity compile, TPU7x: the compiler's account of its own program.

    python -m benchmarks.peak_parts PATH [--set KEY=VALUE ...] [--keep DIR] [--top N]

PATH is a kept file under tests/data/tpu_recipes (as `benchmarks.recipe_rows compile` takes
it). `--set` replaces one of the recipe's MaxText settings (a smaller program of the same
layer: `--set base_num_decoder_layers=5 --set override_model_config=True --set
compile_topology=tpu7x-128`); `--flag` adds a libtpu flag
(`--flag=--xla_tpu_max_hbm_size_mib=N`: the compiler plans for N MiB a device, which it acts
on: a program that needs more is refused with the HBM it was offered). Prints the compiler's
memory per device, then the peak's largest parts; where the peak lies inside a loop (the
scanned layers), that loop's parts too. A part is named by the operation that made it (its
JAX source path, shortened).
"""

from __future__ import annotations

import argparse
import re
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

GB = 1e9
# One entry of the breakdown: its tree prefix, its name and its total bytes.
_ENTRY = re.compile(
    r"^(?P<indent>[ │]*)[├└]── (?P<name>.*) \([0-9.]+%, total: (?P<bytes>[0-9 ]+) bytes"
)


@dataclass
class Part:
    name: str
    bytes: int
    parts: list[Part] = field(default_factory=list)


def peak_parts(live_range: str) -> tuple[int, list[Part]]:
    """The peak's bytes and its top-level parts (each with its own) from XLA's live-range
    dump: the tree under "Stack trace breakdown for peak usage", whose root is the entry
    computation."""
    lines = live_range.splitlines()
    start = next(
        i for i, line in enumerate(lines) if "Stack trace breakdown for peak usage" in line
    )
    peak = int(lines[start].split(":")[1].replace("bytes", "").replace(" ", ""))
    root = Part("peak", peak)
    stack: list[tuple[int, Part]] = [(-1, root)]
    for line in lines[start + 2 :]:
        found = _ENTRY.match(line)
        if not found:
            continue
        depth = len(found["indent"]) // 4
        part = Part(found["name"], int(found["bytes"].replace(" ", "")))
        while stack[-1][0] >= depth:
            stack.pop()
        stack[-1][1].parts.append(part)
        stack.append((depth, part))
    return peak, root.parts


def loop_parts(parts: list[Part]) -> tuple[str, list[Part]] | None:
    """The largest loop among the peak's parts and its body's parts (a `while` holds one
    child, its body computation), or None where no loop is live at the peak."""
    loops = [p for p in parts if _is_loop(p.name) and len(p.parts) == 1]
    if not loops:
        return None
    loop = max(loops, key=lambda p: p.bytes)
    return loop.name, loop.parts[0].parts


def _is_loop(name: str) -> bool:
    """A while loop's name: bare (`while.437`, MaxText's scan) or its JAX source path's last
    step (`jit(train_step)/transpose(jvp(Transformer))/while`, our trainer's)."""
    return re.fullmatch(r"while(\.\d+)?", name.rsplit("/", 1)[-1]) is not None


def short(name: str, width: int = 60) -> str:
    """An operation's JAX source path cut to its last steps (what tells parts apart)."""
    name = name.replace("jit(train_step)/", "").replace("/eval_jaxpr", "")
    return name if len(name) <= width else "..." + name[-(width - 3) :]


def _print(title: str, parts: list[Part], top: int) -> None:
    print(title)
    ranked = sorted(parts, key=lambda p: -p.bytes)
    for part in ranked[:top]:
        print(f"  {part.bytes / GB:7.2f}  {short(part.name, 68)}")
    rest = ranked[top:]
    if rest:
        print(f"  {sum(p.bytes for p in rest) / GB:7.2f}  {len(rest)} smaller parts")


def compile_dump(
    path: str, overrides: tuple[str, ...], work: Path, flags: tuple[str, ...] = ()
) -> str:
    """The kept file's trial 0 compiled through MaxText with XLA's dump under `work`: its
    live-range text (the memory analysis is printed as MaxText prints it)."""
    from benchmarks.recipe_rows import recipe_trial
    from trainer.maxtext.driver import compile_command, run_maxtext
    from trainer.maxtext.logs import memory_analysis
    from trainer.trial.config import load_config
    from trainer.trial.hardware import Backend
    from trainer.trial.maxtext import TRAIN_COMPILE, program_settings

    config, knobs, program = recipe_trial(path)
    settings = program_settings(load_config(config), program, knobs, Backend.TPU)
    argv, env = compile_command(program, settings, work, overrides)
    env["LIBTPU_INIT_ARGS"] = " ".join([env["LIBTPU_INIT_ARGS"], *flags]).strip()
    output = run_maxtext(program.interpreter(), TRAIN_COMPILE, argv, env, lambda _: None)
    if output.returncode:
        raise SystemExit(f"train_compile failed (exit {output.returncode}): {output.text[-2000:]}")
    memory = memory_analysis(output.text)
    if memory is not None:
        gib = {k: memory.get(f"{k}_size_in_bytes", 0) / 2**30 for k in ("argument", "temp")}
        print(f"compiled: {gib['argument']:.2f} GiB of arguments, {gib['temp']:.2f} of "
              "temporaries a device")  # fmt: skip
    (found,) = (work / "hlo").glob("*jit_train_step*after_optimizations-live-range.txt")
    return found.read_text()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("path", help="a kept file under tests/data/tpu_recipes")
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE",
        help="in place of the recipe's own MaxText setting of KEY",
    )  # fmt: skip
    parser.add_argument(
        "--flag",
        action="append",
        default=[],
        help="a libtpu flag for this compile: "
        "--flag=--xla_tpu_max_hbm_size_mib=N compiles as if a device offered N MiB",
    )
    parser.add_argument("--keep", type=Path, help="keep the compile's folder (its dump) here")
    parser.add_argument("--top", type=int, default=16)
    args = parser.parse_args()
    work = args.keep or Path(tempfile.mkdtemp(prefix="peak-parts-"))
    try:
        peak, parts = peak_parts(compile_dump(args.path, tuple(args.set), work, tuple(args.flag)))
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    print(args.path, *args.set, *args.flag, sep="\n  ")
    print(f"peak: {peak / GB:.2f} GB live (XLA's live ranges; host-offloaded buffers among them)")
    _print("GB at the peak, by part:", parts, args.top)
    loop = loop_parts(parts)
    if loop:
        _print(f"GB inside {loop[0]} (the layers' loop) at the peak:", loop[1], args.top)
    print("fidelity: compile, TPU7x (MaxText 0.2.5's program, libtpu's live ranges)")


if __name__ == "__main__":
    main()
