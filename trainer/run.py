"""One training run: validate, build the mesh and state, compile once, train, measure, judge."""

from __future__ import annotations

import contextlib
import math
import os
import signal
import time
from dataclasses import dataclass, field
from typing import Any

import flax.linen as nn
import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from trainer import convergence, metrics
from trainer.config import (
    BATCH_AXES,
    ConfigError,
    MeshConfig,
    TrialConfig,
    check_static,
    global_batch_size,
)
from trainer.data import BatchSource
from trainer.distributed import agree, barrier
from trainer.effects import knob_effects
from trainer.events import (
    Accepted,
    Compiled,
    Emitter,
    FailureClass,
    Fidelity,
    Step,
    TrialFailure,
    hbm_overflow,
)
from trainer.flops import training_flops_per_step
from trainer.hlo import count_collectives, count_matmuls, fingerprint
from trainer.kernels import tokamax_gpu_gmm
from trainer.model import Transformer
from trainer.precision import check_rules_used, quantize
from trainer.remat import checkpoint_policy
from trainer.sharding import (
    LOGICAL_RULES,
    batch_sharding,
    build_mesh,
    check_divisible,
    state_shardings,
)
from trainer.step import make_init_fn, make_optimizer, make_train_step


@dataclass
class RunResult:
    losses: list[float] = field(default_factory=list)
    summary: dict[str, Any] = field(default_factory=dict)


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
    model = Transformer(
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
    init_fn = jax.jit(lambda rng: nn.meta.unbox(init_boxed(rng)), out_shardings=shardings)
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


def _cost(compiled) -> dict[str, float]:
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
    kernels = config.resolved_kernels("gpu", program.degrees["context"])
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
        effects=knob_effects(config, platform, program.degrees, _gpu_gmm(program, devices)),
        **extra,
    )


def train(config: TrialConfig, emitter: Emitter) -> RunResult:
    devices = select_devices(config)
    program = build_program(config, devices)
    platform = devices[0].platform
    cache = convergence.cache_dir(config)
    # A CPU host is its own "chip": count this process' devices, not the whole trial's.
    local_devices = sum(d.process_index == jax.process_index() for d in devices)
    chip = metrics.chip_for(devices[0].device_kind, platform, local_devices, cache)
    emitter.emit(
        accepted_event(config, program, devices, chip.name, chip.devices_per_chip, platform)
    )

    compiled, compile_s = compile_step(program)
    memory = metrics.memory_per_device(compiled)
    hlo = compiled.as_text()
    matmuls = count_matmuls(hlo)
    emitter.emit(
        Compiled(
            compile_s=compile_s,
            memory_per_device=memory,
            cost_per_device=_cost(compiled),
            collectives=count_collectives(hlo),
            matmuls=matmuls,
            program_fingerprint=fingerprint(hlo),
            compile_cache=os.environ.get("JAX_COMPILATION_CACHE_DIR", ""),
        )
    )
    budget = config.limits.device_memory_gib
    if budget is not None and memory.get("total_bytes", 0) > budget * 2**30:
        raise hbm_overflow(memory["total_bytes"], budget * 2**30, "limits.device_memory_gib")

    source = BatchSource(config, program.global_batch, program.degrees["context"])

    def placed(step: int) -> list[jax.Array]:
        batch = source.batch(step)
        return [
            place_batch(a, program.batch_sharding)
            for a in (batch.inputs_BxS, batch.targets_BxS, batch.positions_BxS)
        ]

    state = program.init_fn(
        jax.random.key(config.seed if config.init_seed is None else config.init_seed)
    )
    result = RunResult()
    step_times: list[float] = []  # timed steps (warm-up skipped)
    every_step: list[float] = []
    # Hosts finish compiling at different times: the first step's collectives start together.
    barrier("first-step")
    loop_start = last_done = time.perf_counter()

    def finish(step: int, step_metrics: dict[str, jax.Array]) -> None:
        """Read one step's metrics back (the only block: the next step is already queued)."""
        nonlocal last_done
        values = {k: float(v) for k, v in step_metrics.items()}
        # Completion to completion, with the device never idle in between: the step's time.
        done = time.perf_counter()
        step_time, last_done = done - last_done, done
        every_step.append(step_time)
        result.losses.append(values["loss"])
        if step >= config.measure.skip_steps:
            step_times.append(step_time)
        emitter.emit(Step(step=step, step_time_s=step_time, **values))
        if not all(math.isfinite(v) for v in values.values()):
            raise TrialFailure(
                FailureClass.DIVERGED, f"non-finite metrics at step {step}: {values}", step=step
            )
        limit = config.limits.time_limit_s
        if limit is not None and done - loop_start > limit:
            raise TrialFailure(
                FailureClass.TIMEOUT, f"time limit {limit}s reached after step {step}", step=step
            )

    # The host never waits on the step it just dispatched: the next batch is placed while the
    # device runs, and a step's metrics are read only once its successor is queued.
    pending: tuple[int, dict[str, jax.Array]] | None = None
    arrays = placed(0)
    for step in range(config.steps):
        if step == config.fault.crash_at_step and jax.process_index() == config.fault.crash_process:
            if pending is not None:
                finish(*pending)  # the steps before the crash are reported, as they ran
            if config.fault.crash_mode == "hang":
                while True:  # a wedged host: alive, silent, its peers blocked in collectives
                    time.sleep(3600)
            os.kill(os.getpid(), signal.SIGKILL)  # a real crash: no event, no cleanup
        state, step_metrics = compiled(state, *arrays)
        if step + 1 < config.steps:
            arrays = placed(step + 1)
        if pending is not None:
            finish(*pending)
        pending = (step, step_metrics)
    if pending is not None:
        finish(*pending)
    jax.block_until_ready(state)
    train_s = time.perf_counter() - loop_start
    if not step_times:  # too few steps to skip warm-up: time what there is, and say so
        step_times = every_step[-1:]

    stats = metrics.step_time_stats(step_times)
    tokens_per_step = program.global_batch * config.seq_len
    tokens_per_sec = tokens_per_step / stats["step_time_median_s"]
    chips = len(devices) / chip.devices_per_chip
    flops = training_flops_per_step(config.model, program.global_batch, config.seq_len)
    tflops_per_chip = flops / stats["step_time_median_s"] / chips / 1e12
    precision = "fp8" if config.precision.mode == "fp8" else "bf16"
    peak = metrics.peak_for(chip, precision)
    result.summary = {
        "fidelity": Fidelity.RUN,
        "hardware": chip.name,
        "backend": platform,
        "device_kind": devices[0].device_kind,
        "processes": jax.process_count(),
        "num_devices": len(devices),
        "chips": chips,
        "tokens_per_step": tokens_per_step,
        "tokens_per_sec": tokens_per_sec,
        "tokens_per_sec_per_device": tokens_per_sec / len(devices),
        "tokens_per_sec_per_chip": tokens_per_sec / chips,
        "flops_per_step": flops,
        "tflops_per_sec_per_chip": tflops_per_chip,
        "peak_tflops_per_chip": peak,
        "peak_precision": precision,
        "peak_source": chip.source,
        "mfu": tflops_per_chip / peak if peak else None,
        **stats,
        "compile_s": compile_s,
        "train_s": train_s,
        "memory_per_device": memory,
        "hbm_per_device_gib": memory.get("total_bytes", 0) / 2**30,
        "matmuls": matmuls,
        "final_loss": result.losses[-1],
    }
    if config.convergence.enabled:
        result.summary["convergence"] = check_convergence(
            config,
            result.losses,
            platform,
            program.global_batch,
            len(devices),
            program.degrees["context"],
        )
    return result


def canonical_mesh(config: TrialConfig, num_devices: int) -> MeshConfig:
    """The mesh every trial's reference runs on: FSDP over all devices (the trial's own mesh
    where the recipe's batch does not split that way)."""
    try:
        check_static(config.model_copy(update={"mesh": MeshConfig()}), num_devices)
    except ConfigError:
        return config.mesh
    return MeshConfig()


def baseline_reference(config: TrialConfig, num_devices: int) -> dict[str, Any]:
    """The recipe's convergence reference: a dedicated baseline-numerics run on the canonical
    mesh, and a second one with another initialization (same data) that measures its noise.
    Never a trial's own losses."""
    mesh = canonical_mesh(config, num_devices)
    base = config.baseline().model_copy(update={"mesh": mesh})
    init = config.seed if config.init_seed is None else config.init_seed
    runs = [
        train(base.model_copy(update={"init_seed": seed}), Emitter(quiet=True)).losses
        for seed in (init, init + 1)
    ]
    return convergence.reference_from_runs(
        *runs, config.convergence.window, mesh.model_dump(), [init, init + 1]
    )


def check_convergence(
    config: TrialConfig,
    losses: list[float],
    platform: str,
    global_batch: int,
    num_devices: int,
    context: int = 1,
) -> dict[str, Any]:
    # Every process of a multi-host trial must take the same branch (a baseline run is
    # collective): process 0's view of the cache decides, under the recipe's lock.
    lead = jax.process_index() == 0
    with convergence.lock(config, platform, global_batch) if lead else contextlib.nullcontext():
        reference = convergence.load_reference(config, platform, global_batch)
        source = "cache"
        if not agree(reference is not None):
            reference, source = baseline_reference(config, num_devices), "computed"
            if lead:
                convergence.store_reference(config, platform, global_batch, reference)
    if reference is None:  # process 0's cache answered; this process does not judge
        return {"passed": True, "reason": "judged by process 0", "reference_source": "process 0"}
    judged = convergence.verdict(
        losses, reference, config.convergence.tolerance, config.convergence.window
    )
    judged["reference_source"] = source
    # Baseline numerics: the trial differs from its reference only in how it is sharded.
    judged["baseline_numerics"] = config.is_baseline_numerics(platform, context)
    judged["reference_key"] = convergence.reference_key(config, platform, global_batch)
    return judged
