"""Compile fidelity: the trial's exact train step, AOT-compiled for a TPU topology from abstract state."""

from __future__ import annotations

import os
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
from trainer.program.hlo import count_collectives, fingerprint
from trainer.spec.config import ConfigError, TrialConfig
from trainer.spec.events import (
    Compiled,
    Emitter,
    FailureClass,
    Fidelity,
    TrialFailure,
    classify_exception,
    hbm_overflow,
)
from trainer.spec.files import cache_dir
from trainer.spec.hardware import accelerator_for, chips_in
from trainer.spec.remat import on_device, uses_offload


def topology_devices(target: str) -> list[jax.Device]:
    try:
        chips_in(target)
        accelerator_for(target)
        return list(topologies.get_topology_desc(platform="tpu", topology_name=target).devices)
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
        return {
            "fingerprint": fingerprint(hlo),
            "compile_s": compile_s,
            "memory_per_device": memory_per_device(compiled),
            "collectives": count_collectives(hlo),
            "cost": program_cost(hlo),
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
        other, _ = compile_record(build_program(twin, devices), flags, twin.compile_target, cache)
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
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def compile_for_target(config: TrialConfig, emitter: Emitter) -> dict[str, Any]:
    target = config.compile_target
    accel = accelerator_for(target)
    devices = topology_devices(target)
    program = build_program(config, devices)
    emitter.emit(
        accepted_event(
            config,
            program,
            devices,
            accel.name,
            accel.devices_per_chip,
            "tpu",
            backend="tpu (AOT, no device)",
            fidelity=Fidelity.COMPILE,
            target=target,
            libtpu_init_args=config.xla.libtpu_init_args(),
        )
    )
    cache = ProgramCache(cache_dir(config))
    # The flags libtpu runs with: the host's and the trial's (cli.py put both in the env).
    flags = os.environ.get("LIBTPU_INIT_ARGS", "").split()
    record, shared = compile_record(program, flags, target, cache)
    compile_s, memory, collectives = (
        record["compile_s"],
        record["memory_per_device"],
        record["collectives"],
    )
    fits = memory["total_bytes"] <= accel.usable_hbm_per_device
    # Whether each flag acts is worth a compile only for a program that can run.
    effects = flag_effects(config, record["fingerprint"]) if config.xla.judge and fits else {}
    if config.xla.judge and uses_offload(config.remat):  # judged also when it does not fit
        effects["remat.offload"] = offload_effect(config, devices, memory, flags, cache)
    emitter.emit(
        Compiled(
            compile_s=compile_s,
            memory_per_device=memory,
            collectives=collectives,
            program_fingerprint=record["fingerprint"],
            shared_compile=shared,
            effects=effects,
            program_cost=record["cost"],
        )
    )
    est = estimate(config, accel, len(devices), memory_bytes=memory["total_bytes"])
    # The step time read from the compiled program replaces the formula roofline's.
    cost = record["cost"]
    kernels = kernel_flops(
        config,
        program.global_batch,
        len(devices),
        program.degrees["context"],
        cost.get("kernel_calls"),
        program.degrees["expert"],
        accel.mxu_width,
    )
    model = step_time(cost, accel, kernels)
    tokens = program.global_batch * config.seq_len
    peak = accel.peak_tflops["fp8" if config.precision.mode == "fp8" else "bf16"] * 1e12
    est.update(
        model,
        est_model="hlo",
        est_tokens_per_sec_per_chip=tokens / model["est_step_time_s"] / est["chips"],
        est_mfu=est["model_flops_per_step"] / est["chips"] / model["est_step_time_s"] / peak,
    )
    summary = {
        **est,
        "program_cost": cost,
        "fidelity": Fidelity.COMPILE,
        "figure_fidelity": {
            "compile": [
                "compile_s",
                "program_fingerprint",
                "memory_per_device",
                "hbm_per_device_gib",
                "fits",
                "collectives",
                "program_cost",
            ],
            "estimate": [
                k
                for k in est
                if k.startswith("est_")
                or k in ("bound", "arithmetic_intensity_ici", "arithmetic_intensity_hbm")
            ],
        },
        "target": target,
        "compile_s": compile_s,
        "memory_per_device": memory,
        "hbm_per_device_gib": memory["total_bytes"] / 2**30,
        "fits": fits,
        "collectives": collectives,
        "program_fingerprint": record["fingerprint"],
        "shared_compile": shared,
    }
    if not summary["fits"]:
        raise hbm_overflow(memory["total_bytes"], accel.usable_hbm_per_device, accel.name)
    return summary
