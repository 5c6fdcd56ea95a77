"""One training run: validate, build the mesh and state, compile once, train, measure, judge."""

from __future__ import annotations

import contextlib
import math
import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jax

from trainer.parallel.distributed import agree, barrier
from trainer.program.build import (
    Program,
    accepted_event,
    build_program,
    compile_step,
    memory_per_device,
    place_batch,
    select_devices,
    xla_cost,
)
from trainer.program.hlo import count_collectives, count_matmuls, fingerprint, parse
from trainer.run import convergence, metrics
from trainer.run.data import BatchSource
from trainer.trial.checks import check_static
from trainer.trial.config import ConfigError, MeshConfig, ProfileConfig, TrialConfig
from trainer.trial.events import (
    Compiled,
    Emitter,
    FailureClass,
    Fidelity,
    Step,
    TrialFailure,
    hbm_overflow,
)
from trainer.trial.files import cache_dir
from trainer.trial.flops import training_flops_per_step
from trainer.trial.hardware import GIB, Backend
from trainer.trial.timing import step_time_stats, throughput_interval


@dataclass
class RunResult:
    losses: list[float] = field(default_factory=list)
    summary: dict[str, Any] = field(default_factory=dict)


@dataclass
class Timed:
    """What the training loop measured."""

    losses: list[float] = field(default_factory=list)
    step_times: list[float] = field(default_factory=list)  # timed steps (warm-up skipped)
    every_step: list[float] = field(default_factory=list)
    train_s: float = 0.0
    contention: float | None = None  # share of the trial's cores other processes used
    profile_dir: str | None = None  # where a profiler trace of some steps was written


def train(config: TrialConfig, emitter: Emitter) -> RunResult:
    """Build, compile and train the trial's program on this host's devices; its summary at
    run fidelity, and its convergence verdict."""
    devices = select_devices(config)
    config, tuned, tuning = timed_tiles_of(config, devices)
    program = build_program(config, devices)
    platform = devices[0].platform
    # A CPU host is its own "chip": count this process' devices, not the whole trial's.
    local_devices = sum(d.process_index == jax.process_index() for d in devices)
    chip = metrics.chip_for(devices[0].device_kind, platform, local_devices, cache_dir(config))
    emitter.emit(
        accepted_event(config, program, devices, chip.name, chip.devices_per_chip, platform)
    )
    compiled, figures = _compile(config, program, emitter, tuned, tuning)
    timed = _train_loop(config, program, compiled, emitter)
    summary = {**_measured(config, program, devices, chip, timed), **figures}
    if config.convergence.enabled:
        summary["convergence"] = check_convergence(
            config,
            timed.losses,
            platform,
            program.global_batch,
            len(devices),
            program.degrees["context"],
        )
    return RunResult(timed.losses, summary)


def timed_tiles_of(
    config: TrialConfig, devices: list[jax.Device]
) -> tuple[TrialConfig, dict[str, dict[str, str]], dict[str, Any] | None]:
    """`kernels.tune: time` on a TPU: the trial running the tiles tune-jax timed fastest on
    its first device (trainer/compile/tiles/timing.py), the effect, and the record; else the
    trial as it is (the accepted event says why the knob is inert)."""
    if config.kernels.tune != "time" or devices[0].platform != "tpu":
        return config, {}, None
    if jax.process_count() > 1:  # each host would time its own: they must run one program
        why = "not timed across several hosts yet (each would choose on its own device)"
        return config, {"kernels.tune": {"status": "inert", "reason": why}}, None
    from trainer.compile.tiles.search import applied
    from trainer.compile.tiles.timing import timed_tiles
    from trainer.trial.checks import global_batch_size

    degrees = config.mesh.resolve(len(devices))
    batch = global_batch_size(config, len(devices))
    tuning, untuned = timed_tiles(config, batch, degrees, devices[0], cache_dir(config))
    how = f"timed by tune-jax on {devices[0].device_kind}"
    return applied(config, tuning, untuned, how, "timed fastest")


def _compile(
    config: TrialConfig,
    program: Program,
    emitter: Emitter,
    tuned: dict[str, dict[str, str]],
    tuning: dict[str, Any] | None,
) -> tuple[Any, dict]:
    """The compiled step, its `compiled` event (with what `kernels.tune: time` did), and its
    figures for the summary; a program over the trial's memory budget is out of memory here,
    before it runs."""
    compiled, compile_s = compile_step(program)
    memory = memory_per_device(compiled)
    hlo = compiled.as_text()
    module = parse(hlo)
    matmuls = count_matmuls(module)
    emitter.emit(
        Compiled(
            compile_s=compile_s,
            memory_per_device=memory,
            cost_per_device=xla_cost(compiled),
            collectives=count_collectives(module),
            matmuls=matmuls,
            program_fingerprint=fingerprint(hlo),
            compile_cache=os.environ.get("JAX_COMPILATION_CACHE_DIR", ""),
            effects=tuned,
            kernel_tuning=tuning,
        )
    )
    budget = config.limits.device_memory_gib
    if budget is not None and memory.get("total_bytes", 0) > budget * GIB:
        raise hbm_overflow(memory["total_bytes"], budget * GIB, "limits.device_memory_gib")
    return compiled, {
        "compile_s": compile_s,
        "memory_per_device": memory,
        "hbm_per_device_gib": memory.get("total_bytes", 0) / GIB,
        "matmuls": matmuls,
    }


class Trace:
    """A JAX profiler trace of `profile.steps` steps from `profile.start_step` (none without
    a profile): started as the first is dispatched, stopped once the last has been read."""

    def __init__(self, profile: ProfileConfig | None):
        self.profile = profile
        self.dir: str | None = None
        if profile is not None:
            self.dir = str(Path(profile.dir or "profile").resolve())

    def covers(self, step: int) -> bool:
        p = self.profile
        return p is not None and p.start_step <= step < p.start_step + p.steps

    def before(self, step: int) -> None:
        if self.profile is not None and step == self.profile.start_step and self.dir:
            jax.profiler.start_trace(self.dir)

    def after(self, step: int) -> None:
        if self.profile is not None and step == self.profile.start_step + self.profile.steps - 1:
            jax.profiler.stop_trace()


class _Steps:
    """Reads each step's metrics back once its successor is queued: its time, completion to
    completion, a `diverged` failure on non-finite metrics, a `timeout` past the limit."""

    def __init__(self, config: TrialConfig, emitter: Emitter, trace: Trace):
        self.config, self.emitter, self.trace = config, emitter, trace
        self.timed = Timed()
        self.loop_start = self.last_done = time.perf_counter()

    def finish(self, step: int, step_metrics: dict[str, jax.Array]) -> None:
        """Read one step's metrics back (the only block: the next step is already queued)."""
        config, timed = self.config, self.timed
        values = {k: float(v) for k, v in step_metrics.items()}
        # Completion to completion, with the device never idle in between: the step's time.
        done = time.perf_counter()
        step_time, self.last_done = done - self.last_done, done
        timed.every_step.append(step_time)
        timed.losses.append(values["loss"])
        if step >= config.measure.skip_steps and not self.trace.covers(step):
            timed.step_times.append(step_time)
        self.emitter.emit(Step(step=step, step_time_s=step_time, **values))
        if not all(math.isfinite(v) for v in values.values()):
            raise TrialFailure(
                FailureClass.DIVERGED, f"non-finite metrics at step {step}: {values}", step=step
            )
        limit = config.limits.time_limit_s
        if limit is not None and done - self.loop_start > limit:
            raise TrialFailure(
                FailureClass.TIMEOUT, f"time limit {limit}s reached after step {step}", step=step
            )


def _injected_fault(config: TrialConfig, step: int) -> bool:
    return step == config.fault.crash_at_step and jax.process_index() == config.fault.crash_process


def _crash(config: TrialConfig) -> None:
    """The fault a test asked for: a wedged host, or a real crash."""
    if config.fault.crash_mode == "hang":
        while True:  # a wedged host: alive, silent, its peers blocked in collectives
            time.sleep(3600)
    os.kill(os.getpid(), signal.SIGKILL)  # a real crash: no event, no cleanup


def _train_loop(config: TrialConfig, program: Program, compiled: Any, emitter: Emitter) -> Timed:
    """Train for `config.steps` steps, each timed completion to completion; a step with
    non-finite metrics is `diverged`, a loop past `limits.time_limit_s` a `timeout`."""
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
    trace = Trace(config.profile)
    # Hosts finish compiling at different times: the first step's collectives start together.
    barrier("first-step")
    steps = _Steps(config, emitter, trace)
    contention = metrics.Contention()
    # The host never waits on the step it just dispatched: the next batch is placed while the
    # device runs, and a step's metrics are read only once its successor is queued.
    pending: tuple[int, dict[str, jax.Array]] | None = None
    arrays = placed(0)
    for step in range(config.steps):
        if _injected_fault(config, step):
            if pending is not None:
                steps.finish(*pending)  # the steps before the crash are reported, as they ran
            _crash(config)
        trace.before(step)
        state, step_metrics = compiled(state, *arrays)
        if step + 1 < config.steps:
            arrays = placed(step + 1)
        if pending is not None:
            steps.finish(*pending)
            trace.after(pending[0])
        pending = (step, step_metrics)
    if pending is not None:
        steps.finish(*pending)
        trace.after(pending[0])
    jax.block_until_ready(state)
    timed = steps.timed
    timed.contention = contention.share()
    timed.profile_dir = trace.dir
    timed.train_s = time.perf_counter() - steps.loop_start
    if not timed.step_times:  # too few steps to skip warm-up: time what there is, and say so
        timed.step_times = timed.every_step[-1:]
    return timed


def _measured(
    config: TrialConfig, program: Program, devices: list, chip: metrics.Chip, timed: Timed
) -> dict[str, Any]:
    """The run's figures: throughput, model TFLOP/s and MFU against the chip's peak of the
    step's precision, step-time statistics."""
    stats = step_time_stats(timed.step_times, config.measure.windows)
    tokens_per_step = program.global_batch * config.seq_len
    tokens_per_sec = tokens_per_step / stats["step_time_median_s"]
    chips = len(devices) / chip.devices_per_chip
    per_chip = tokens_per_step / chips
    flops = training_flops_per_step(config.model, program.global_batch, config.seq_len)
    tflops_per_chip = flops / stats["step_time_median_s"] / chips / 1e12
    precision = config.precision.peak
    peak = metrics.peak_for(chip, precision)
    return {
        "fidelity": Fidelity.RUN,
        "hardware": chip.name,
        "backend": devices[0].platform,
        "device_kind": devices[0].device_kind,
        "processes": jax.process_count(),
        "num_devices": len(devices),
        "chips": chips,
        "tokens_per_step": tokens_per_step,
        "tokens_per_sec": tokens_per_sec,
        "tokens_per_sec_per_device": tokens_per_sec / len(devices),
        "tokens_per_sec_per_chip": tokens_per_sec / chips,
        # The median step's 95% interval, as throughput (a slower step is fewer tokens/s).
        **throughput_interval(stats, per_chip / stats["step_time_median_s"]),
        "cpu_contention": timed.contention if devices[0].platform == "cpu" else None,
        "flops_per_step": flops,
        "tflops_per_sec_per_chip": tflops_per_chip,
        "peak_tflops_per_chip": peak,
        "peak_precision": precision,
        "peak_source": chip.source,
        "mfu": tflops_per_chip / peak if peak else None,
        **stats,
        "train_s": timed.train_s,
        "profile_dir": timed.profile_dir,
        "final_loss": timed.losses[-1],
        "peak_hbm_per_device_gib": _peak_memory_gib(devices),
    }


def _peak_memory_gib(devices: list) -> float | None:
    """The most memory any of this process's devices held, by its runtime (None where it
    keeps no such count: XLA's CPU devices)."""
    peaks = []
    for device in devices:
        if device.process_index != jax.process_index():
            continue
        try:
            stats = device.memory_stats() or {}
        except Exception:  # a backend without memory statistics
            return None
        if "peak_bytes_in_use" in stats:
            peaks.append(stats["peak_bytes_in_use"])
    return max(peaks) / GIB if peaks else None


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
        runs[0], runs[1], config.convergence.window, mesh.model_dump(), [init, init + 1]
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
    judged["baseline_numerics"] = config.is_baseline_numerics(Backend(platform), context)
    judged["reference_key"] = convergence.reference_key(config, platform, global_batch)
    return judged
