"""Knob values that have no effect on the sweep's target are pinned away before sampling.

A trial spent on an inert value measures its twin again and records a difference that
does not exist; so such values are dropped from the space, and the sweep says so.
"""

from __future__ import annotations

import json

from sweeper.space import Knob, Space, gpus_in
from trainer.effects import FP8_EMULATED, NO_HOST_OFFLOAD, PALLAS_NATIVE
from trainer.policies import OFFLOAD_TWINS

NOT_PALLAS = tuple(b for b in ("cpu", "gpu") if b not in PALLAS_NATIVE)


# Values whose throughput on a backend says nothing about the target: measuring them would
# rank an emulation. Their numerics are checked by the trainer's tests, not by such a sweep.
# Each entry: the value kept, the backends where the others are pinned away, and why.
THROUGHPUT_MEANINGLESS = {
    "precision.mode": (
        "bf16",
        FP8_EMULATED,
        "XLA on {b} upcasts fp8 to f32: fp8 speed there is emulation",
    ),
    "kernels.attention": (
        "xla",
        NOT_PALLAS,
        "Pallas Splash is a TPU kernel: interpreted on {b}",
    ),
    "kernels.moe_gmm": (
        "ragged_dot",
        NOT_PALLAS,
        "Pallas Megablox is a TPU kernel: interpreted on {b}",
    ),
}


def target_backend(space: Space) -> str:
    """The backend of a space's trials when nothing else is known: a compile target's TPU,
    the backend a local space asks for, else cpu (the engine passes the real one)."""
    if space.is_tpu_target and space.effective_fidelity != "run":
        return "tpu"
    requested = str(space.trial.get("backend", "auto"))
    if requested != "auto":
        return requested
    return "cpu" if space.target == "local" else "gpu" if gpus_in(space.target) else "tpu"


def _drop(knob: Knob, inert: set, twin_of: dict) -> Knob:
    kept: list = []
    for value in knob.values:
        replacement = twin_of.get(value, value) if value in inert else value
        if replacement not in kept:
            kept.append(replacement)
    return knob.model_copy(update={"values": kept})


def _pin_first(knob: Knob) -> tuple[Knob, object]:
    """The knob reduced to its first value (the low end of a range), and that value."""
    first = knob.values[0] if knob.values else knob.low
    return Knob(values=[first], when=knob.when), first


def pin_inert(space: Space, backend: str | None = None) -> tuple[Space, list[str]]:
    """The space with values that are inert (or only emulated) on the backend its trials run
    on removed, and a note for each. TPU trials keep every value."""
    backend = backend or target_backend(space)
    if backend == "tpu":
        return space, []
    notes, knobs = [], dict(space.knobs)
    policy = knobs.get("remat.policy")
    if policy and policy.values and backend in NO_HOST_OFFLOAD:
        inert = {v for v in policy.values if v in OFFLOAD_TWINS}
        if inert:
            knobs["remat.policy"] = _drop(policy, inert, OFFLOAD_TWINS)
            notes.append(
                f"remat.policy: {sorted(inert)} are inert on {backend} (host offload is dropped; they compile to "
                f"their remat twins {[OFFLOAD_TWINS[v] for v in sorted(inert)]}); not sampled"
            )
    for key, knob in space.knobs.items():
        if (
            key.startswith("remat.custom.")
            and knob.values
            and "offload" in knob.values
            and backend in NO_HOST_OFFLOAD
        ):
            knobs[key] = _drop(knob, {"offload"}, {"offload": "remat"})
            notes.append(
                f"{key}: 'offload' is inert on {backend} (same program as 'remat'); not sampled"
            )
        elif key in THROUGHPUT_MEANINGLESS and knob.values:
            keep, backends, reason = THROUGHPUT_MEANINGLESS[key]
            dropped = [v for v in knob.values if v != keep]
            if dropped and backend in backends:
                knobs[key] = knob.model_copy(update={"values": [keep]})
                notes.append(
                    f"{key}: {dropped} pinned to {keep!r} on {backend} ({reason.format(b=backend)})"
                )
        elif key.startswith("xla."):
            knobs[key], first = _pin_first(knob)
            notes.append(
                f"{key}: pinned to {first!r} on {backend} (LIBTPU flags do not reach the {backend} backend)"
            )
        elif key.startswith("kernels.block_") or key.startswith("kernels.gmm_t"):
            knobs[key], first = _pin_first(knob)
            notes.append(
                f"{key}: pinned to {first} on {backend} (TPU kernels are interpreted there: tiles have no speed meaning)"
            )
    return space.model_copy(update={"knobs": knobs}), notes


def effect_caveats(effects_per_trial: list[str | None]) -> list[str]:
    """What the trials themselves reported as not acting fully on their backend (the trainer's
    `effects`: inert, emulated, interpreted), one line per knob and status with a trial count."""
    seen: dict[tuple[str, str], tuple[str, int]] = {}
    for raw in effects_per_trial:
        if not raw or not isinstance(raw, str):
            continue
        for knob, effect in json.loads(raw).items():
            if effect.get("status", "active") == "active":
                continue
            key = (knob, effect["status"])
            reason, count = seen.get(key, (effect.get("reason", ""), 0))
            seen[key] = (reason, count + 1)
    return [
        f"{knob} {status} in {count} trial{'s' if count > 1 else ''}: {reason}"
        for (knob, status), (reason, count) in sorted(seen.items())
    ]
