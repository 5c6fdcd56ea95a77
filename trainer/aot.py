"""Compile fidelity: the trial's exact train step, AOT-compiled for a TPU topology from abstract state."""

from __future__ import annotations

from typing import Any

import jax
from jax.experimental import topologies

from trainer import metrics
from trainer.config import ConfigError, TrialConfig
from trainer.estimate import estimate
from trainer.events import (
    Compiled,
    Emitter,
    FailureClass,
    Fidelity,
    TrialFailure,
    classify_exception,
    hbm_overflow,
)
from trainer.hardware import accelerator_for, chips_in
from trainer.hlo import count_collectives
from trainer.run import accepted_event, build_program, compile_step


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
    try:
        compiled, compile_s = compile_step(program)
    except Exception as exc:
        failure_class = classify_exception(exc, "compile")
        if failure_class == FailureClass.COMPILE_ERROR and isinstance(exc, ValueError):
            failure_class = (
                FailureClass.INVALID_CONFIG
            )  # e.g. kernel blocks the kernel itself rejects
        raise TrialFailure(failure_class, f"{type(exc).__name__}: {str(exc)[:3000]}") from None
    memory = metrics.memory_per_device(compiled)
    collectives = count_collectives(compiled.as_text())
    emitter.emit(Compiled(compile_s=compile_s, memory_per_device=memory, collectives=collectives))
    est = estimate(config, accel, len(devices), memory_bytes=memory["total_bytes"])
    summary = {
        **est,
        "fidelity": Fidelity.COMPILE,
        "figure_fidelity": {
            "compile": [
                "compile_s",
                "memory_per_device",
                "hbm_per_device_gib",
                "fits",
                "collectives",
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
        "fits": memory["total_bytes"] <= accel.usable_hbm_per_device,
        "collectives": collectives,
    }
    if not summary["fits"]:
        raise hbm_overflow(memory["total_bytes"], accel.usable_hbm_per_device, accel.name)
    return summary
