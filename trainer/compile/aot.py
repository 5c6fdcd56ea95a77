"""Compile fidelity: the trial's exact train step, AOT-compiled for a TPU topology from abstract state."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import jax
from jax.experimental import topologies

from trainer.compile.cost import program_cost
from trainer.compile.records import ProgramCache, cached_compile, flag_effects, program_key
from trainer.compile.step_model import kernel_flops, step_time
from trainer.estimate.analytic import estimate
from trainer.program.build import (
    accepted_event,
    build_program,
    compile_step,
    lower_step,
    memory_per_device,
)
from trainer.program.hlo import count_collectives, fingerprint, parse
from trainer.trial.config import ConfigError, TrialConfig
from trainer.trial.events import (
    Compiled,
    Emitter,
    FailureClass,
    Fidelity,
    TrialFailure,
    Tuning,
    classify_exception,
    hbm_overflow,
)
from trainer.trial.files import cache_dir
from trainer.trial.hardware import GIB, Topology
from trainer.trial.remat import on_device, uses_offload

# libtpu's default host of a topology it is asked for: 2x2x1 chips. A slice smaller than that
# (v5e:1x1, one chip) is refused by libtpu 0.0.42.1 unless the host is given as the slice
# ("Topology layout "v5e:1x1" is not divisible by the given (or default)
# chips_per_host_bounds "2x2x1"").
DEFAULT_HOST_BOUNDS = (2, 2, 1)


def topology_devices(target: str) -> list[jax.Device]:
    try:
        topology = Topology.parse(target)
        if topology.slices > 1:
            raise ValueError(
                f"{target} is several slices joined by the data center network; this trainer "
                "compiles one slice (its mesh has no DCN axes): MaxText trials compile multi-slice"
            )
        dims = (*topology.dims, 1, 1)[:3]
        kwargs = {}
        if any(d < b for d, b in zip(dims, DEFAULT_HOST_BOUNDS, strict=True)):
            kwargs["chips_per_host_bounds"] = tuple(
                min(d, b) for d, b in zip(dims, DEFAULT_HOST_BOUNDS, strict=True)
            )
        found = topologies.get_topology_desc(
            platform="tpu", topology_name=topology.target, **kwargs
        )
        return list(found.devices)
    except ValueError as exc:
        raise ConfigError("compile_target", str(exc)) from None
    except Exception as exc:  # libtpu's own rejection of a topology string
        raise ConfigError(
            "compile_target", f"libtpu rejected {target!r}: {str(exc)[:300]}"
        ) from None


def compile_record(
    program: Any, flags: list[str], target: str, cache: ProgramCache
) -> tuple[dict[str, Any], bool]:
    """The compile record of `program` (fingerprint, memory, collectives, counted cost), and
    whether another trial had compiled the same program already."""
    lowered = lower_step(program)
    key = program_key(lowered.as_text(), flags, target)

    def compile_now() -> dict[str, Any]:
        try:
            compiled, compile_s = compile_step(program, lowered)
        except Exception as exc:
            failure_class = classify_exception(exc, "compile")
            if failure_class == FailureClass.COMPILE_ERROR and isinstance(exc, ValueError):
                failure_class = (
                    FailureClass.INVALID_CONFIG
                )  # e.g. kernel blocks the kernel itself rejects
            raise TrialFailure(failure_class, f"{type(exc).__name__}: {str(exc)[:3000]}") from None
        hlo = compiled.as_text()
        module = parse(hlo)
        return {
            "fingerprint": fingerprint(hlo),
            "compile_s": compile_s,
            "memory_per_device": memory_per_device(compiled),
            "collectives": count_collectives(module),
            "cost": program_cost(module),
        }

    return cached_compile(key, cache, compile_now)


def offload_effect(
    config: TrialConfig,
    devices: list[jax.Device],
    memory: dict[str, int],
    flags: list[str],
    cache: ProgramCache,
) -> dict[str, str]:
    """`active` when offloading lowers device memory below the same policy with the offloaded
    tensors kept on device (a second compile, in this process: same flags), else `inert`:
    host offload that saves no device memory only adds host-link traffic. Device memory is
    libtpu's arguments + temp, as for `fits`."""
    twin = config.model_copy(update={"remat": on_device(config.remat)})
    try:
        target = Topology.parse(config.compile_target or "").target
        other, _ = compile_record(build_program(twin, devices), flags, target, cache)
    except TrialFailure as exc:
        return {
            "status": "active",
            "reason": f"kept on device, the program does not compile ({exc.failure_class.value})",
        }
    offloaded, on_dev = memory["total_bytes"], other["memory_per_device"]["total_bytes"]
    figures = (
        f"device memory {_size(offloaded)} offloaded vs {_size(on_dev)} with the same tensors "
        f"on device; host {_size(memory.get('host_temp_size_in_bytes', 0))}"
    )
    if offloaded < on_dev:
        return {"status": "active", "reason": f"saves {_size(on_dev - offloaded)}: {figures}"}
    return {"status": "inert", "reason": f"saves no device memory: {figures}"}


def _size(n: int) -> str:
    return f"{n / GIB:.2f} GiB" if n >= GIB else f"{n / 2**20:.1f} MiB"


def compile_for_target(config: TrialConfig, emitter: Emitter) -> dict[str, Any]:
    """The trial's summary at compile fidelity: its program compiled for the target (what the
    compiler says) and the step time read from that program (an estimate)."""
    topology = Topology.parse(config.compile_target or "")
    accel = topology.accelerator
    devices = topology_devices(topology.target)
    program = build_program(config, devices)
    emitter.emit(
        accepted_event(
            config, program, devices, accel.name, accel.devices_per_chip, "tpu",
            backend="tpu (AOT, no device)", fidelity=Fidelity.COMPILE, target=topology.target,
            libtpu_init_args=config.xla.libtpu_init_args(),
        )
    )  # fmt: skip
    # The tuner compiles kernels alone (the trial says `compiling` meanwhile), then the
    # trial's program is built again with the blocks it chose.
    config, tuned, tuning = tuned_blocks(config, topology, devices, emitter=emitter)
    if tuning is not None:
        program = build_program(config, devices)
    cache = ProgramCache(cache_dir(config))
    # The flags libtpu runs with: the host's and the trial's (cli.py put both in the env).
    flags = os.environ.get("LIBTPU_INIT_ARGS", "").split()
    record, shared = compile_record(program, flags, topology.target, cache)
    memory = record["memory_per_device"]
    fits = True  # libtpu refuses a program over the device's HBM (compile_summary)
    emitter.emit(
        Compiled(
            compile_s=record["compile_s"],
            memory_per_device=memory,
            collectives=record["collectives"],
            program_fingerprint=record["fingerprint"],
            shared_compile=shared,
            effects={**_judged_effects(config, devices, record, fits, flags, cache), **tuned},
            kernel_tuning=tuning,
            program_cost=record["cost"],
        )
    )
    summary = compile_summary(
        config, program.global_batch, program.degrees, topology, record, shared
    )
    return summary


def tuned_blocks(
    config: TrialConfig,
    topology: Topology,
    devices: list[jax.Device],
    untaken: Mapping[str, str] | None = None,
    how: str = "tuned",
    emitter: Emitter | None = None,
) -> tuple[TrialConfig, dict[str, dict[str, str]], dict[str, Any] | None]:
    """`kernels.tune: compile`: the trial with each tunable kernel's tiles the tuner chose
    (trainer/compile/tiles/), its effect (active where it changed a tile, inert where the
    trial's own were the best or nothing could be tuned), and the tuning's record (None
    when the tuner did not run). `untaken`: kinds of kernel the program takes no tiles for
    (MaxText's), and why; `how`: how the effect says they were tuned; `emitter`: told of each
    compile the tuner begins (a `tuning` event: how many of about how many)."""
    if config.kernels.tune != "compile":
        return config, {}, None
    from trainer.compile.tiles.search import applied, tune
    from trainer.trial.checks import global_batch_size

    degrees = config.mesh.resolve(topology.devices)
    batch = global_batch_size(config, topology.devices)

    def told(done: int, total: int, kernel: str) -> None:
        if emitter is not None:
            emitter.emit(Tuning(done=done, total=total, kernel=kernel))

    tuning, untuned = tune(config, batch, degrees, topology, devices[0], cache_dir(config),
                           untaken=untaken, progress=told)  # fmt: skip
    return applied(config, tuning, untuned, how, "priced lowest")


def compile_summary(
    config: TrialConfig,
    global_batch: int,
    degrees: dict[str, int],
    topology: Topology,
    record: dict[str, Any],
    shared: bool = False,
) -> dict[str, Any]:
    """A trial's summary at compile fidelity from its compile record (ours, or MaxText's
    program): the compiler's figures, and the step time read from the program (estimates);
    `oom_hbm` over the space's memory budget. Whether it fits the device is libtpu's verdict:
    a program over the device's HBM does not compile (`oom_hbm` from its refusal). XLA's memory
    analysis is an upper bound of what the program holds at once: on the lent v5e, programs
    it put at 17.57 GiB, which libtpu compiled, ran on 15.75 GiB (docs/calibration.md, TPU
    v5e), where the engine's own test of that figure against the device had refused them."""
    memory = record["memory_per_device"]
    budget = config.limits.device_memory_gib  # the space's constraints.max_memory_per_device_gib
    if budget is not None and memory["total_bytes"] > budget * GIB:
        raise hbm_overflow(memory["total_bytes"], budget * GIB, "limits.device_memory_gib")
    compiled = {
        "compile_s": record["compile_s"],
        "program_fingerprint": record["fingerprint"],
        "memory_per_device": memory,
        "hbm_per_device_gib": memory["total_bytes"] / GIB,
        "fits": True,
        "collectives": record["collectives"],
        "program_cost": record["cost"],
    }
    estimated = estimate_from_compile(config, global_batch, degrees, topology, record)
    return {
        **estimated,
        **compiled,
        "fidelity": Fidelity.COMPILE,
        "target": topology.target,
        "shared_compile": shared,
        "figure_fidelity": {
            "compile": list(compiled),
            "estimate": [k for k in estimated if k.startswith("est_") or k in _ESTIMATED],
        },
    }


# Estimated figures of a compile trial beside the est_* ones.
_ESTIMATED = ("bound", "arithmetic_intensity_ici", "arithmetic_intensity_hbm")


def _judged_effects(
    config: TrialConfig,
    devices: list[jax.Device],
    record: dict[str, Any],
    fits: bool,
    flags: list[str],
    cache: ProgramCache,
) -> dict[str, dict[str, str]]:
    """Flag knobs and host offload judged by compiling their twins (`flag_effects`,
    `offload_effect`); whether each flag acts is worth a compile only for a program that can
    run, offload is judged also when it does not fit."""
    if not config.xla.judge:
        return {}
    effects = flag_effects(config, record["fingerprint"]) if fits else {}
    if uses_offload(config.remat):
        memory = record["memory_per_device"]
        effects["remat.offload"] = offload_effect(config, devices, memory, flags, cache)
    return effects


def estimate_from_compile(
    config: TrialConfig,
    global_batch: int,
    degrees: dict[str, int],
    topology: Topology,
    record: dict[str, Any],
) -> dict[str, Any]:
    """The analytic estimate with the compiler's memory, and the step time read from the
    compiled program (its cost and schedule) in place of the formula roofline's. `record`:
    the compile's memory per device and its program's cost (ours, or MaxText's program)."""
    accel, devices = topology.accelerator, topology.devices
    memory = record["memory_per_device"]["total_bytes"]
    est = estimate(config, accel, devices, memory_bytes=memory)
    cost = record["cost"]
    kernels = kernel_flops(
        config,
        global_batch,
        devices,
        degrees["context"],
        cost["kernel_calls"],
        degrees["expert"],
        accel.mxu_width,
    )
    model = step_time(cost, accel, kernels)
    step_s, chips = model["est_step_time_s"], est["chips"]
    peak = accel.peak_of(config.precision.peak) * 1e12
    formula_only = ("est_serial_s",)  # the schedule's own exposed time replaces it
    return {
        **{k: v for k, v in est.items() if k not in formula_only},
        **model,
        "est_model": "hlo",
        "est_tokens_per_sec_per_chip": global_batch * config.seq_len / step_s / chips,
        "est_mfu": est["model_flops_per_step"] / chips / step_s / peak,
    }
