"""The trainer's programs compiled for an NVIDIA H200 on a host without one (compile fidelity).

    python -m benchmarks.gpu_compile [--cases moe-8x,moe-8x-ragged-dot,dense-3b-fp8]
                                     [--json results.jsonl]

XLA compiles for a GPU it does not have when given the GPU's description (a deviceless
topology; JAX's `topologies.get_topology_desc(platform="cuda", target_config=...)`). It needs
the CUDA plugin, which `make gpu-compile` puts in `.gpu-compile/` (180 MB; not in the venv,
where it would try to start CUDA in every process), and runs with JAX_PLATFORMS=cpu: this
script runs each case in a child with both. What such a compile shows is the program XLA
builds for the GPU: which matrix products become GEMMs or Triton kernels, which take fp8
operands, which temporaries exist and how many FLOPs the dots really do. What it cannot
show: speed, and which GEMM implementation autotuning would pick on the device (there is
none to autotune on: XLA takes its default tiles, `--xla_gpu_autotune_level=0`), and cuDNN
fusions (attention, which needs the device's cuDNN; the cases use XLA attention here).

The cases are `benchmarks.accelerator_mfu`'s, at full size, one device. The table: compile
seconds here; the dot FLOPs the compiled program does per step against the model's (6N +
attention, as MaxText counts); kernel calls (Triton, Mosaic GPU); fp8 products; the
largest temporary; memory per device.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from trainer.trial.hardware import GIB

# The H200 as XLA's GPU compiler sees it (xla/stream_executor/device_description.proto),
# with the figures NVIDIA publishes and those the device reported (docs/facts.md, H200).
H200_TARGET_CONFIG = """
gpu_device_info {
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: 233472
  threads_per_core_limit: 2048
  core_count: 132
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: 4800000000000
  l2_cache_size: 52428800
  clock_rate_ghz: 1.98
  device_memory_size: 150121545728
  shared_memory_per_block_optin: 232448
  cuda_compute_capability { major: 9 }
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}
platform_name: "CUDA"
dnn_version_info { major: 9 minor: 10 }
runtime_version { major: 12 minor: 8 }
device_description_str: "NVIDIA H200"
"""
PLUGIN_DIR = Path(__file__).resolve().parent.parent / ".gpu-compile"
DEFAULT_CASES = "moe-8x,moe-8x-ragged-dot,dense-3b,dense-3b-fp8"
# Custom calls that are kernels of their own: Pallas Triton and Mosaic GPU (tokamax's).
_KERNELS = ("__gpu$xla.gpu.triton", "mosaic_gpu")


def h200_devices() -> list:
    """One deviceless H200 (needs JAX_PLATFORMS=cpu and the CUDA plugin)."""
    from jax.experimental import topologies

    try:
        topology = topologies.get_topology_desc(
            platform="cuda", target_config=H200_TARGET_CONFIG, topology="1x1x1"
        )
    except Exception as exc:
        raise SystemExit(
            f"no deviceless CUDA compiler here ({type(exc).__name__}: {str(exc)[:200]}); "
            "install it with `make gpu-compile`"
        ) from None
    return list(topology.devices)


def program_figures(hlo: str) -> dict[str, Any]:
    """What the compiled GPU program does in one step (loops counted by their trips): dot
    FLOPs, GEMM custom calls, kernel calls (Pallas Triton or Mosaic GPU, such as tokamax's
    grouped matmul), fp8 products, and the largest value a dot reads or writes."""
    from trainer.compile.cost import program_cost
    from trainer.program.hlo import count_matmuls, nbytes, parse

    cost = program_cost(hlo)
    calls = cost["custom_calls"]
    computations, _, types = parse(hlo)
    largest = max(
        (
            (nbytes(value), value.split("{")[0])
            for instrs in computations.values()
            for instr in instrs
            if instr.opcode in ("dot", "convolution")
            for value in (instr.type, *(types.get(o, "") for o in instr.operands))
        ),
        default=(0.0, ""),
    )
    matmuls = count_matmuls(hlo)
    return {
        "dot_flops": cost["flops_total"],
        "kernel_calls": sum(n for t, n in calls.items() if t.startswith(_KERNELS)),
        "gemm_calls": sum(n for t, n in calls.items() if "gemm" in t or "matmul" in t),
        "fp8_gemm_calls": sum(n for t, n in calls.items() if t.endswith("$f8")),
        "matmuls_in_text": matmuls["total"],
        "fp8_matmuls_in_text": matmuls["fp8"],
        "largest_dot_value": largest[1],
        "largest_dot_value_bytes": largest[0],
    }


def compile_case(name: str) -> dict[str, Any]:
    """Compile one case for the H200 in this process and return its figures."""
    from benchmarks.accelerator_mfu import split_case, trial
    from trainer.model.grouped_matmul import experts_run_as
    from trainer.program.build import build_program, compile_step, lower_step, memory_per_device
    from trainer.trial.config import load_config
    from trainer.trial.flops import training_flops_per_step

    recipe = trial(split_case(name)[0], steps=2, cpu=False)
    # cuDNN attention compiles only against the device's cuDNN: XLA attention stands in.
    recipe["kernels"] = {**recipe.get("kernels", {}), "attention": "xla"}
    config = load_config(recipe)
    devices = h200_devices()
    program = build_program(config, devices)
    compiled, compile_s = compile_step(program, lower_step(program))
    figures = program_figures(compiled.as_text())
    model_flops = training_flops_per_step(config.model, program.global_batch, config.seq_len)
    kernels = config.resolved_kernels("gpu")
    return {
        "case": name,
        "fidelity": "compile",
        "hardware": "NVIDIA H200 (deviceless XLA:GPU compile, no autotuning)",
        "moe_gmm": experts_run_as(kernels.moe_gmm, "gpu", devices[0])
        if config.model.is_moe
        else None,
        "precision": config.precision.mode,
        "compile_s": compile_s,
        "model_flops": model_flops,
        "dot_flops_over_model": figures["dot_flops"] / model_flops,
        "memory_per_device": memory_per_device(compiled),
        **figures,
    }


def _child(name: str) -> None:
    print(json.dumps(compile_case(name)), flush=True)


def compile_env() -> dict[str, str]:
    """The environment of a deviceless GPU compile: the CUDA plugin on the path, no backend
    but the CPU's started (so the plugin checks for no CUDA libraries), no autotuning."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(PLUGIN_DIR), str(PLUGIN_DIR.parent), env.get("PYTHONPATH")) if p
    )
    flags = env.get("XLA_FLAGS", "")
    env["XLA_FLAGS"] = f"{flags} --xla_gpu_autotune_level=0".strip()
    return env


def run_case(name: str, timeout: int) -> dict[str, Any]:
    """One case compiled in a child process (see `compile_env`): its figures, or its error."""
    cmd = [sys.executable, "-m", "benchmarks.gpu_compile", "--child", name]
    try:
        done = subprocess.run(
            cmd, env=compile_env(), capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired:
        return {"case": name, "error": f"timed out after {timeout} s"}
    for line in reversed(done.stdout.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    errors = [line for line in done.stderr.splitlines() if "Error" in line or "error" in line]
    return {"case": name, "error": (errors or ["no output"])[-1][:300]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cases", default=DEFAULT_CASES)
    parser.add_argument("--timeout", type=int, default=900)
    parser.add_argument("--json", default=None, help="append one JSON line per case")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child(args.child)
        return
    console = Console(width=200)
    table = Table(title="Compiled for an NVIDIA H200 here (fidelity: compile; no speed)")
    for col in ("case", "gmm", "compile s", "dot FLOPs / model", "kernel calls",
                "fp8 / matmuls", "largest dot value", "temp GiB"):  # fmt: skip
        table.add_column(col)
    for name in args.cases.split(","):
        console.print(f"compiling {name} ...")
        row = run_case(name, args.timeout)
        if args.json:
            with open(args.json, "a") as out:
                out.write(json.dumps(row) + "\n")
        if "error" in row:
            table.add_row(name, *[""] * 6, f"failed: {row['error']}")
            continue
        table.add_row(
            name,
            row["moe_gmm"] or "-",
            f"{row['compile_s']:.1f}",
            f"{row['dot_flops_over_model']:.2f}",
            str(row["kernel_calls"]),
            f"{row['fp8_matmuls_in_text']} / {row['matmuls_in_text']}",
            f"{row['largest_dot_value']} ({row['largest_dot_value_bytes'] / GIB:.2f} GiB)",
            f"{row['memory_per_device']['temp_size_in_bytes'] / GIB:.2f}",
        )
    console.print(table)


if __name__ == "__main__":
    main()
