"""The trainer on whatever accelerator is present, against that accelerator's limit.

    python -m benchmarks.accelerator_mfu [--cases dense-1.3b,dense-3b,dense-3b-fp8,moe-8x]
                                         [--steps 20] [--json results.jsonl]

A case name may carry a compiler variant, `dense-3b-fp8+autotune-0` (XLA_VARIANTS).

First the matmul peak measured here (8192^3, bf16 and fp8 operands, best of 10), then the
trainer (run fidelity, synthetic data, remat minimal, kernels `auto` unless a case says
otherwise) on the models below. Each case runs in its own process with its own timeout, so
one that fails or runs long costs only itself. The table gives tokens/s, model TFLOP/s
(6N + causal attention, as MaxText counts), MFU against the datasheet and against the peak
measured in the same run, compile time, and how many of the compiled program's matrix
products take fp8 operands.

Fidelity: run, on this machine's accelerator. On a CPU host the same script runs (tiny
steps prove the wiring) and says so; CPU figures say nothing about an accelerator.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any

from rich.console import Console
from rich.table import Table

DENSE_1B = dict(
    vocab_size=32768,
    d_model=2048,
    num_layers=16,
    num_heads=16,
    num_kv_heads=16,
    head_dim=128,
    mlp_dim=8192,
)
DENSE_3B = {**DENSE_1B, "d_model": 3072, "num_layers": 24, "num_heads": 24, "num_kv_heads": 24}
MOE = {**DENSE_1B, "num_layers": 8, "mlp_dim": 2048, "num_experts": 8, "experts_per_token": 2}

# name -> (model, per-device batch, trial overrides)
CASES: dict[str, tuple[dict, int, dict]] = {
    "dense-1.3b": (DENSE_1B, 16, {}),
    "dense-1.3b-xla-attention": (DENSE_1B, 16, {"kernels": {"attention": "xla"}}),
    "dense-3b": (DENSE_3B, 8, {}),
    "dense-3b-fp8": (DENSE_3B, 8, {"precision": {"mode": "fp8"}}),
    "moe-8x": (MOE, 16, {}),
    "moe-8x-ragged-dot": (MOE, 16, {"kernels": {"moe_gmm": "ragged_dot"}}),
    "moe-8x-tokamax": (MOE, 16, {"kernels": {"moe_gmm": "tokamax"}}),
    "dense-3b-fp8-fixed": (DENSE_3B, 8, {"precision": {"mode": "fp8", "scaling": "fixed"}}),
    # Sized for a 16 GiB chip (TPU v5e): the presets of the v5e spaces (search_spaces/v5e_*).
    "v5e-dense": ({"preset": "v5e-dense-270m"}, 8, {}),
    "v5e-dense-int8": (
        {"preset": "v5e-dense-270m"},
        8,
        {"precision": {"mode": "int8", "granularity": "per_axis"}},
    ),
    "v5e-dense-fp8": ({"preset": "v5e-dense-270m"}, 8, {"precision": {"mode": "fp8"}}),
    "v5e-dense-vmem64m": ({"preset": "v5e-dense-270m"}, 8, {"xla": {"scoped_vmem_kib": 65536}}),
    "v5e-moe": ({"preset": "v5e-moe-300m"}, 8, {}),
}
# The cases a run takes by default, by the chip's memory (float32 weights, gradients and AdamW
# moments take 16 bytes a parameter: the 1.3B-3B cases ask 30-48 GiB).
DEFAULT_CASES = "dense-1.3b,dense-3b,dense-3b-fp8,moe-8x"
SMALL_CHIP_CASES = "v5e-dense,v5e-dense-int8,v5e-dense-fp8,v5e-moe"
SMALL_CHIP_GIB = 32
# Compiler variants of a case: `CASE+VARIANT` runs CASE with these XLA flags added. The fp8
# compile (121 s against 10 s for bf16 on the H200) is mostly GEMM autotuning; these say how
# much, and what the step pays without it (compare a variant against bf16 with the same one).
XLA_VARIANTS: dict[str, str] = {
    "no-triton-gemm": "--xla_gpu_enable_triton_gemm=false",
    "autotune-1": "--xla_gpu_autotune_level=1",
    "autotune-0": "--xla_gpu_autotune_level=0",
}
# A CPU host runs the same cases at toy size: the wiring, never a finding.
CPU_SHAPE = dict(d_model=128, num_layers=2, num_heads=2, num_kv_heads=2, head_dim=64, mlp_dim=256)


def split_case(name: str) -> tuple[str, str]:
    """`dense-3b-fp8+autotune-0` -> ("dense-3b-fp8", "--xla_gpu_autotune_level=0")."""
    case, _, variant = name.partition("+")
    if case not in CASES or (variant and variant not in XLA_VARIANTS):
        raise SystemExit(
            f"unknown case {name!r}: cases {sorted(CASES)}, variants +{sorted(XLA_VARIANTS)}"
        )
    return case, XLA_VARIANTS.get(variant, "")


def trial(name: str, steps: int, cpu: bool, platform: str = "auto") -> dict[str, Any]:
    """The trial configuration of case `name`; `platform` the backend it runs on (a sweep's
    trials name theirs: on TPU, its LIBTPU flags then reach libtpu as a trial's do)."""
    model, batch, extra = CASES[split_case(name)[0]]
    if "preset" in model:
        from trainer.trial.presets import MODEL_PRESETS

        model = {**MODEL_PRESETS[model["preset"]], **model}
    model = {**model, **(CPU_SHAPE if cpu else {})}
    if cpu and "num_experts" in model:
        model["mlp_dim"] = 128
    model.setdefault("preset", "small-moe" if "num_experts" in model else "small-dense")
    return {
        "model": model,
        "seq_len": 256 if cpu else 2048,
        "per_device_batch": 2 if cpu else batch,
        "steps": steps,
        "num_devices": 1,
        "remat": {"policy": "minimal"},
        "measure": {"skip_steps": min(5, steps // 2)},
        "convergence": {"enabled": False},
        "backend": "cpu" if cpu else platform,
        **extra,
    }


def measure_peak(dtype_name: str, size: int, repeats: int = 10) -> float:
    """Best-of-`repeats` TFLOP/s of one size^3 product (bf16 out) on the default device."""
    import jax
    import jax.numpy as jnp

    dtype = {"bf16": jnp.bfloat16, "fp8": jnp.float8_e4m3fn, "int8": jnp.int8}[dtype_name]
    scale = 100.0 if dtype_name == "int8" else 1.0
    a = (jax.random.normal(jax.random.key(0), (size, size)) * scale).astype(dtype)
    b = (jax.random.normal(jax.random.key(1), (size, size)) * scale).astype(dtype)
    out = jnp.int32 if dtype_name == "int8" else jnp.bfloat16
    matmul = jax.jit(lambda x, y: jnp.dot(x, y, preferred_element_type=out))
    matmul(a, b).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        matmul(a, b).block_until_ready()
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best / 1e12


def child_peak() -> dict[str, Any]:
    import jax

    device = jax.devices()[0]
    size = 8192 if device.platform != "cpu" else 1024
    peaks: dict[str, Any] = {"bf16": measure_peak("bf16", size)}
    for low in ("fp8", "int8"):
        try:
            peaks[low] = measure_peak(low, size)
        except Exception as exc:  # a backend without such products says so in the table
            peaks[f"{low}_error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
    stats = device.memory_stats() or {}
    memory = stats.get("bytes_limit")
    return {"platform": device.platform, "device_kind": device.device_kind, "size": size,
            "memory_gib": memory / 2**30 if memory else None, **peaks}  # fmt: skip


def relative_max_errors(parts, got, exact) -> dict[str, float]:
    """Each part's largest absolute error, relative to the exact part's largest magnitude."""
    import numpy as np

    return {
        part: float(np.max(np.abs(a - e)) / np.max(np.abs(e)))
        for part, a, e in zip(parts, got, exact, strict=True)
    }


def child_attention_check() -> dict[str, Any]:
    """The fused attention against a float32 reference, forward and gradients, beside the
    bf16 XLA reference's own error: the fused kernel must be no less accurate."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from trainer.model.attention import fused_attention, reference_attention

    platform = jax.devices()[0].platform
    b, s, h, kv, d = 2, 1024, 8, 4, 128
    keys = jax.random.split(jax.random.key(0), 4)
    q, k, v, g = (
        jax.random.normal(key, (b, s, h if i in (0, 3) else kv, d)) for i, key in enumerate(keys)
    )
    pos = jnp.broadcast_to(jnp.arange(s), (b, s))

    def reference(q, k, v):
        return reference_attention(q, k, v, pos, pos)

    def fused(q, k, v):
        return fused_attention(q, k, v, "cudnn" if platform == "gpu" else "xla")

    def with_grads(fn, dtype):
        args = [x.astype(dtype) for x in (q, k, v)]
        out, vjp = jax.vjp(jax.jit(fn), *args)
        return [np.asarray(x, np.float32) for x in (out, *vjp(g.astype(dtype)))]

    exact = with_grads(reference, jnp.float32)
    errors = {}
    for name, fn in (("xla_bf16", reference), ("fused_bf16", fused)):
        got = with_grads(fn, jnp.bfloat16)
        errors[name] = relative_max_errors(("out", "dq", "dk", "dv"), got, exact)
    return {"platform": platform, "relative_max_error": errors}


def child_gmm_check() -> dict[str, Any]:
    """The experts' grouped matmul as `moe_gmm: auto` runs it here (tokamax's GPU kernel on
    a GPU) against a float32 reference, forward and gradients, beside bf16 XLA ragged_dot's
    own error: the kernel must be no less accurate. Uneven groups, one of them empty."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from trainer.model.grouped_matmul import default_device, experts_run_as, grouped_matmul
    from trainer.trial.config import KernelsConfig

    platform = jax.devices()[0].platform
    m, k, n = 4096, 2048, 1024
    sizes = jnp.array([1000, 0, 2500, 596], jnp.int32)
    keys = jax.random.split(jax.random.key(0), 3)
    x, w = jax.random.normal(keys[0], (m, k)), jax.random.normal(keys[1], (4, k, n)) / k**0.5
    g = jax.random.normal(keys[2], (m, n))

    def with_grads(kernels, dtype):
        def fn(x, w):
            return grouped_matmul(x, w, sizes, kernels, platform != "tpu", platform)

        out, vjp = jax.vjp(jax.jit(fn), x.astype(dtype), w.astype(dtype))
        return [np.asarray(a, np.float32) for a in (out, *vjp(g.astype(dtype)))]

    exact = with_grads(KernelsConfig(moe_gmm="ragged_dot"), jnp.float32)
    errors = {}
    for name, gmm in (("ragged_dot_bf16", "ragged_dot"), ("auto_bf16", "auto")):
        got = with_grads(KernelsConfig(moe_gmm=gmm), jnp.bfloat16)
        errors[name] = relative_max_errors(("out", "dx", "dw"), got, exact)
    auto = KernelsConfig().resolved_moe_gmm(platform)
    return {
        "platform": platform,
        "auto_runs_as": experts_run_as(auto, platform, default_device()),
        "relative_max_error": errors,
    }


def child_fp8_hlo() -> dict[str, Any]:
    """Where the fp8 of a 2-layer model goes in the compiled program: its matrix products
    and every instruction that reads an fp8 operand, by opcode."""
    import collections
    import re

    import jax

    from trainer.program.build import build_program, compile_step
    from trainer.program.hlo import count_matmuls
    from trainer.trial.config import load_config

    config = load_config(trial("dense-3b-fp8", 2, jax.devices()[0].platform == "cpu"))
    config = config.model_copy(update={"model": config.model.model_copy(update={"num_layers": 2})})
    compiled, compile_s = compile_step(build_program(config, jax.devices()[:1]))
    text = compiled.as_text()
    readers = collections.Counter()
    targets = collections.Counter(re.findall(r'custom_call_target="([^"]+)"', text))
    for line in text.splitlines():
        m = re.match(r"\s*(?:ROOT\s+)?%\S+ = .*? ([a-z-]+)\((.*)", line)
        if m and re.search(r"\bf8e(?:4m3|5m2)\w*\[", m.group(2)):
            readers[m.group(1)] += 1
    return {
        "compile_s": compile_s,
        "matmuls": count_matmuls(text),
        "fp8_operand_readers": dict(readers),
        "custom_call_targets": dict(targets),
    }


def child_case(name: str, steps: int, platform: str) -> dict[str, Any]:
    from trainer.cli import prepare_environment
    from trainer.trial.config import load_config

    config = load_config(trial(name, steps, platform == "cpu", platform))
    prepare_environment(config)  # its LIBTPU flags, before libtpu starts: as a trial's process
    import jax

    from trainer.model.grouped_matmul import experts_run_as
    from trainer.run.train import train
    from trainer.trial.events import Emitter

    device = jax.devices()[0]
    summary = train(config, Emitter(quiet=True)).summary
    if config.model.is_moe:
        moe_gmm = config.resolved_kernels(device.platform).moe_gmm
        summary["experts_run_as"] = experts_run_as(moe_gmm, device.platform, device)
    keep = (
        "tokens_per_sec",
        "tflops_per_sec_per_chip",
        "mfu",
        "peak_tflops_per_chip",
        "step_time_median_s",
        "compile_s",
        "hbm_per_device_gib",
        "matmuls",
        "hardware",
        "backend",
        "final_loss",
        "experts_run_as",
    )
    return {"case": name, **{k: summary.get(k) for k in keep}}


def run_child(args: list[str], timeout: float, xla_flags: str = "") -> dict[str, Any]:
    """One measurement in its own process; a failure or a timeout is a row, not a crash."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if xla_flags:
        env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {xla_flags}".strip()
    start = time.perf_counter()
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "benchmarks.accelerator_mfu", *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=env,
        )
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode or not lines:
        return {"error": f"exit {proc.returncode}: {proc.stderr.strip()[-600:]}"}
    result = json.loads(lines[-1].removeprefix("RESULT "))
    result["wall_s"] = time.perf_counter() - start
    return result


def _fmt(value: Any, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--cases",
        default=None,
        help=f"default: {DEFAULT_CASES}; on a chip under {SMALL_CHIP_GIB} GiB, {SMALL_CHIP_CASES}",
    )
    parser.add_argument("--platform", default="auto", help=argparse.SUPPRESS)
    parser.add_argument("--checks", default="", help="attention-check,gmm-check,fp8-hlo")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--timeout", type=float, default=300, help="seconds per case")
    parser.add_argument("--budget", type=float, default=None, help="seconds for all cases")
    parser.add_argument("--json", default=None, help="append every row to this JSONL file")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        special = {
            "peak": child_peak,
            "attention-check": child_attention_check,
            "gmm-check": child_gmm_check,
            "fp8-hlo": child_fp8_hlo,
        }
        result = (
            special[args.child]()
            if args.child in special
            else child_case(args.child, args.steps, args.platform)
        )
        print("RESULT " + json.dumps(result), flush=True)
        return

    if args.cases:
        for name in args.cases.split(","):
            split_case(name)  # every name checked before a run
    console = Console(width=200)
    deadline = time.monotonic() + args.budget if args.budget else None
    peak = run_child(["--child", "peak"], args.timeout)
    console.print(f"matmul peak (fidelity: run): {peak}")
    small = (peak.get("memory_gib") or SMALL_CHIP_GIB) < SMALL_CHIP_GIB
    cases = args.cases or (SMALL_CHIP_CASES if small else DEFAULT_CASES)
    names = cases.split(",")
    flags = {name: split_case(name)[1] for name in names}
    platform = peak.get("platform", "auto")
    rows = [peak]
    table = Table(
        title=f"trainer on {peak.get('device_kind', '?')} (fidelity: run, "
        f"{'CPU: wiring only, not a finding' if peak.get('platform') == 'cpu' else 'synthetic data'})"
    )
    for col in (
        "case",
        "tokens/s",
        "TFLOP/s",
        "MFU datasheet",
        "MFU measured peak",
        "step s",
        "compile s",
        "HBM GiB",
        "fp8 / matmuls",
    ):
        table.add_column(col, justify="right")
    for check in args.checks.split(",") if args.checks else []:
        row = run_child(["--child", check], args.timeout)
        console.print(f"{check} (fidelity: run): {row}")
        rows.append({"check": check, **row})
    for name in names:
        timeout = args.timeout
        if deadline is not None:
            timeout = min(timeout, deadline - time.monotonic())
            if timeout < 30:
                rows.append({"case": name, "error": "not run: budget spent"})
                table.add_row(name, "not run: budget spent", *[""] * 7)
                continue
        console.print(f"[{time.strftime('%H:%M:%S')}] {name} ...")
        child = ["--child", name, "--steps", str(args.steps), "--platform", platform]
        row = {"case": name, "xla_flags": flags[name], **run_child(child, timeout, flags[name])}
        rows.append(row)
        console.print(row)
        if "error" in row:
            table.add_row(name, row["error"][:60], *[""] * 7)
            continue
        tflops = row["tflops_per_sec_per_chip"]
        low = next((p for p in ("fp8", "int8") if f"-{p}" in name), "bf16")
        measured = peak.get(low)
        matmuls = row.get("matmuls") or {}
        table.add_row(
            name,
            f"{row['tokens_per_sec']:,.0f}",
            f"{tflops:.0f}",
            _fmt(row["mfu"], ".3f"),
            _fmt(tflops / measured if measured else None, ".3f"),
            f"{row['step_time_median_s']:.3f}",
            f"{row['compile_s']:.0f}",
            f"{row['hbm_per_device_gib']:.1f}",
            f"{matmuls.get('fp8', 0)} / {matmuls.get('total', 0)}",
        )
    console.print(table)
    if args.json:
        with open(args.json, "a") as out:
            for row in rows:
                out.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
