"""The program of a trial: mesh, model, state and the jitted train step, built from a
configuration for a list of devices (attached ones, or an AOT target's), then lowered and
compiled. The run loop and the compile fidelity share it."""

from __future__ import annotations

import contextlib
import math
import os
import signal
import time
from dataclasses import dataclass
from typing import Any

import flax.linen as nn
import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from trainer.model.grouped_matmul import tokamax_gpu_gmm
from trainer.model.precision import check_rules_used, quantize
from trainer.model.remat import checkpoint_policy
from trainer.model.transformer import Transformer
from trainer.parallel.sharding import (
    LOGICAL_RULES,
    batch_sharding,
    build_mesh,
    check_divisible,
    state_shardings,
)
from trainer.program.step import make_init_fn, make_optimizer, make_train_step
from trainer.trial.checks import check_static, global_batch_size
from trainer.trial.config import BATCH_AXES, ConfigError, TrialConfig
from trainer.trial.effects import knob_effects
from trainer.trial.events import MEMORY_FIELDS, Accepted, memory_record
from trainer.trial.hardware import Backend

# The state's init runs once: on CPU, LLVM's optimizations of its thousands of unrolled RNG
# ops took 5-6 s of a tiny model's 14 s trial, and 0.9 s without (same shapes and shardings;
# values may differ in the last bit from an optimized init). The step is compiled as it is.
INIT_COMPILE_OPTIONS = {"cpu": {"xla_backend_optimization_level": 0}}


def select_devices(config: TrialConfig) -> list[jax.Device]:
    devices = jax.devices() if config.backend == "auto" else jax.devices(config.backend)
    if config.num_devices is not None:
        if config.num_devices > len(devices):
            raise ConfigError(
                "num_devices", f"{config.num_devices} requested but only {len(devices)} available"
            )
        devices = devices[: config.num_devices]
    return devices


@dataclass
class Program:
    """The compiled step and everything needed to feed it."""

    config: TrialConfig
    mesh: Any
    degrees: dict[str, int]
    global_batch: int
    init_fn: Any
    step_fn: Any
    state_shardings: Any
    batch_sharding: NamedSharding
    abstract_state: Any


def build_program(config: TrialConfig, devices: list[jax.Device]) -> Program:
    """Everything up to (not including) compilation; raises ConfigError for impossible setups."""
    n = len(devices)
    platform = devices[0].platform
    degrees = check_static(config, n, platform)
    global_batch = global_batch_size(config, n)
    mesh = build_mesh(degrees, devices)
    kernels = config.resolved_kernels(platform, degrees["context"])
    expert_fp8 = config.precision if config.fp8_experts_in_tokamax(platform) else None
    model: nn.Module = Transformer(
        config.model,
        checkpoint_policy(config.remat),
        kernels=kernels,
        platform=platform,
        load_balanced=degrees["context"] > 1 and config.mesh.context_load_balance,
        vocab_tiling=config.vocab_tiling,
        expert_fp8=expert_fp8,
    )
    model, provider = quantize(model, config.precision, expert_fp8 is not None)
    tx = make_optimizer(config)
    batch_shards = math.prod(degrees[a] for a in BATCH_AXES)
    init_boxed = make_init_fn(model, tx, config, (batch_shards, config.seq_len))
    # Abstract key: a concrete one would be placed on the mesh's devices, which for an AOT
    # target do not exist on this host.
    abstract_key = jax.eval_shape(lambda: jax.random.key(0))
    with tracing_on(mesh):
        abstract_boxed = jax.eval_shape(init_boxed, abstract_key)
        shardings = state_shardings(abstract_boxed, mesh)
    check_rules_used(provider)
    abstract = nn.meta.unbox(abstract_boxed)
    check_divisible(abstract, shardings, mesh)
    data_sharding = batch_sharding(mesh)
    replicated = NamedSharding(mesh, PartitionSpec())
    init_fn = jax.jit(
        lambda rng: nn.meta.unbox(init_boxed(rng)),
        out_shardings=shardings,
        compiler_options=INIT_COMPILE_OPTIONS.get(platform),
    )
    step_fn = jax.jit(
        make_train_step(model, tx, config),
        in_shardings=(shardings, data_sharding, data_sharding, data_sharding),
        out_shardings=(shardings, replicated),
        donate_argnums=(0,),
    )
    abstract_state = jax.tree.map(
        lambda leaf, s: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=s),
        abstract,
        shardings,
    )
    return Program(
        config,
        mesh,
        degrees,
        global_batch,
        init_fn,
        step_fn,
        shardings,
        data_sharding,
        abstract_state,
    )


def place_batch(array: np.ndarray, sharding: NamedSharding) -> jax.Array:
    """The global batch as one array; each process places only its addressable shards."""
    return jax.make_array_from_callback(array.shape, sharding, lambda index: array[index])


@contextlib.contextmanager
def tracing_on(mesh: Mesh):
    """Where the model is traced (its init, its step): the mesh, its logical axis rules, and
    the mesh's device as the default one. Kernel libraries pick an implementation by the
    default device (tokamax's ragged_dot: its Mosaic kernels on a TPU, its GPU kernels on a
    GPU), so an AOT compile on a CPU host gets the program the target's host would."""
    with (
        mesh,
        jax.set_mesh(mesh),
        nn.logical_axis_rules(LOGICAL_RULES),
        jax.default_device(mesh.devices.flat[0]),
    ):
        yield


def lower_step(program: Program):
    """The train step lowered for the program's mesh (what the compiler is given)."""
    batch = jax.ShapeDtypeStruct(
        (program.global_batch, program.config.seq_len), np.int32, sharding=program.batch_sharding
    )
    with tracing_on(program.mesh):
        return program.step_fn.lower(program.abstract_state, batch, batch, batch)


def compile_step(program: Program, lowered=None):
    """The compiled train step and its lowering + compile time (compile only, when given
    the lowering)."""
    start = time.perf_counter()
    lowered = lowered if lowered is not None else lower_step(program)
    fault = program.config.fault
    if fault.crash_in_compile:
        os.kill(os.getpid(), signal.SIGSEGV)  # as a compiler crash: no event, no cleanup
    if fault.slow_compile_s and jax.process_index() == fault.crash_process:
        time.sleep(fault.slow_compile_s)
    with program.mesh, jax.set_mesh(program.mesh), nn.logical_axis_rules(LOGICAL_RULES):
        compiled = lowered.compile()
    return compiled, time.perf_counter() - start


def xla_cost(compiled) -> dict[str, float]:
    cost = compiled.cost_analysis()
    if isinstance(cost, list):
        cost = cost[0] if cost else {}
    return {
        k: float(v)
        for k, v in (cost or {}).items()
        if k in ("flops", "bytes accessed", "transcendentals")
    }


def _gpu_gmm(program: Program, devices: list) -> tuple[str | None, dict[str, str]] | None:
    """Which tokamax grouped matmul a GPU program's experts run (see `tokamax_gpu_gmm`)."""
    config = program.config
    if devices[0].platform != "gpu" or not config.model.is_moe:
        return None
    kernels = config.resolved_kernels(Backend.GPU, program.degrees["context"])
    return tokamax_gpu_gmm(devices[0]) if kernels.moe_gmm == "tokamax" else None


def accepted_event(
    config: TrialConfig,
    program: Program,
    devices: list,
    hardware: str,
    devices_per_chip: int,
    platform: str,
    **extra: Any,
) -> Accepted:
    """The `accepted` event of a run or a compile: the program as built, and its knobs' effects."""
    return Accepted(
        config=config.model_dump(mode="json"),
        backend=extra.pop("backend", platform),
        device_kind=devices[0].device_kind,
        hardware=hardware,
        processes=jax.process_count(),
        num_devices=len(devices),
        chips=len(devices) / devices_per_chip,
        tokens_per_step=program.global_batch * config.seq_len,
        mesh=program.degrees,
        global_batch=program.global_batch,
        effects=knob_effects(
            config, Backend(platform), program.degrees, _gpu_gmm(program, devices)
        ),
        **extra,
    )


def memory_per_device(compiled: Any) -> dict[str, int]:
    analysis = compiled.memory_analysis()
    if analysis is None:
        return {}
    return memory_record({f: getattr(analysis, f, 0) for f in MEMORY_FIELDS})
