"""LIBTPU_INIT_ARGS validation: an unknown flag aborts libtpu's whole process, so probe in a child."""

from __future__ import annotations

import functools
import os
import re
import subprocess
import sys
import tempfile

# The host's LIBTPU_INIT_ARGS before a trial adds its own (a twin compile starts there).
BASE_LIBTPU_ARGS = "SWEEPER_BASE_LIBTPU_INIT_ARGS"

# Compiler thread stacks for compile trials. libtpu 0.0.42.1 overflows a compiler fiber's
# stack (SIGSEGV in SpatialMajorConvolution::EmitZeroByteCase's recursive cost estimate)
# compiling qwen3-235b's MoE layer at its recipe's batch; with 32 MiB stacks the same program
# compiles. Host settings of the compiler, not of the program (a small model compiles to the
# same fingerprint with and without them).
COMPILER_STACKS = (
    "--fibers_default_thread_stack_size=33554432",
    "--xla_internal_thread_stack_size_bytes=33554432",
    "--default_thread_stack_size=33554432",
)

# XLA's ragged_dot (moe_gmm ragged_dot, and `auto` on TPU) as libtpu's ragged-dot kernels.
# libtpu 0.0.42.1 took them by default; 0.0.52 lowers ragged_dot to a dense dot over every
# expert unless told (one MoE layer, 8 experts, tpu7x:2x2x1: 860.7 GFLOP counted without the
# flag, 36.0 with it, the rest in 12 ragged-dot kernel calls). A program setting of every TPU
# trial, as the trainer's meaning of ragged_dot on TPU: no ragged_dot, no effect.
RAGGED_DOT_KERNEL = "--xla_tpu_enable_ragged_dot_kernel=true"

# Flag bundles a trial's xla.collective_mode names (docs/reference.md, xla.collective_mode).
SPARSECORE_OFFLOAD = (
    "--xla_tpu_enable_sparse_core_collective_offload_all_gather=true",
    "--xla_tpu_enable_sparse_core_collective_offload_reduce_scatter=true",
    "--xla_tpu_enable_sparse_core_collective_offload_all_reduce=true",
    "--xla_tpu_enable_async_collective_fusion_fuse_all_gather=false",
    "--xla_tpu_enable_async_collective_fusion_fuse_reduce_scatter=false",
    "--xla_tpu_enable_async_collective_fusion_fuse_all_reduce=false",
    "--xla_tpu_use_tc_device_shape_on_sc=true",
    "--xla_sc_disable_megacore_partitioning=true",
)
ASYNC_FUSION = (
    "--xla_tpu_enable_async_collective_fusion=true",
    "--xla_tpu_enable_async_collective_fusion_fuse_all_gather=true",
    "--xla_tpu_enable_async_collective_fusion_multiple_steps=true",
    "--xla_tpu_overlap_compute_collective_tc=true",
    "--xla_enable_async_all_gather=true",
)

# libtpu's layer scheduler, set by deepseek-v3's and gpt-oss-120b's published recipes (libtpu
# refuses it without --xla_tpu_enable_sparse_core_collective_aggregator=true). With it the
# unembedding's weight gradient no longer waits for the layers' backward: the logits' gradient
# is not kept beside them (compiled for TPU7x, 2026-12-07: qwen3-235b's MaxText recipe with it
# 60.34 GiB a device, no logits' gradient at the peak, 80.33 without; deepseek-v3's without it
# keeps its 8.47 GB beside the layers' loop: benchmarks/data/floor_predictions.csv).
LAYER_SCHEDULER = "--xla_tpu_enable_latency_hiding_layer_scheduler"


def flag_on(flags: list[str], name: str) -> bool:
    """Whether the last of `flags` that sets the boolean flag `name` (`--name`, `--name=true`,
    `=1`, `=ENABLED`) turns it on: libtpu reads the last (a compile with the layer scheduler set
    true, then false, kept the logits' gradient it keeps without the flag)."""
    value = None
    for flag in flags:
        key, _, given = flag.partition("=")
        if key == name:
            value = given or "true"
    return value is not None and value.lower() in ("true", "1", "enabled")


_PROBE = (
    "from jax.experimental import topologies\n"
    "topologies.get_topology_desc(platform='tpu', topology_name='tpu7x:2x2x1')\n"
    "print('LIBTPU_FLAGS_OK')\n"
)
_UNKNOWN = re.compile(r"Unknown command line flag '([^']+)'[^\n]*")


@functools.cache
def unknown_flag(flags: tuple[str, ...]) -> str | None:
    """The first flag libtpu rejects, with its message, or None when libtpu accepts them all."""
    if not flags:
        return None
    with tempfile.TemporaryDirectory(prefix="sweeper-flags-") as logs:
        env = {
            **os.environ,
            "LIBTPU_INIT_ARGS": " ".join(flags),
            "JAX_PLATFORMS": "cpu",
            "ALLOW_MULTIPLE_LIBTPU_LOAD": "1",  # the probe opens no device; trials may compile
            "TPU_ACCELERATOR_TYPE": "tpu7x-8",
            "TPU_WORKER_HOSTNAMES": "localhost",
            "TPU_LOG_DIR": logs,  # libtpu's logs of the probe: gone with it, not left in /tmp
        }
        proc = subprocess.run(
            [sys.executable, "-c", _PROBE], capture_output=True, text=True, env=env, timeout=300
        )
    if "LIBTPU_FLAGS_OK" in proc.stdout:
        return None
    match = _UNKNOWN.search(proc.stderr + proc.stdout)
    if match:
        return match.group(0)
    return f"libtpu did not start with these flags (exit {proc.returncode}): {(proc.stderr or proc.stdout)[-500:]}"
