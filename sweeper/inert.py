"""Knob values that have no effect on the sweep's target are pinned away before sampling.

A trial spent on an inert value measures its twin again and records a difference that
does not exist; so such values are dropped from the space, and the sweep says so.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from sweeper.space import Knob, Space, target_backend
from trainer.spec.config import KernelsConfig, PrecisionConfig
from trainer.spec.effects import (
    CUDNN,
    FP8_EMULATED,
    NO_HOST_OFFLOAD,
    PALLAS_NATIVE,
    TOKAMAX_GMM_KERNEL,
)
from trainer.spec.remat import OFFLOAD_TWINS

# Values whose throughput on a backend says nothing about the target: measuring them would
# rank an emulation. Their numerics are checked by the trainer's tests, not by such a sweep.
THROUGHPUT_MEANINGLESS = {
    "precision.mode": (
        "bf16",
        FP8_EMULATED,
        "XLA on {b} upcasts fp8 to f32: fp8 speed there is emulation",
    ),
}

# Kernel choices: what each value runs as on a backend (`auto` resolved; a TPU kernel off
# TPU is interpreted, cuDNN exists on GPUs only); values that run as another are its twin.
KERNEL_CHOICES: dict[
    str, tuple[str, Callable[[str, str], str], dict[str, tuple[str, ...]], str]
] = {
    "kernels.attention": (
        "xla",
        lambda v, b: KernelsConfig(attention=v).resolved_attention(b),
        {"splash": PALLAS_NATIVE, "cudnn": CUDNN},
        "Pallas Splash is a TPU kernel, interpreted elsewhere; cuDNN runs on NVIDIA GPUs only",
    ),
    "kernels.moe_gmm": (
        "ragged_dot",
        lambda v, b: KernelsConfig(moe_gmm=v).resolved_moe_gmm(b),
        {"megablox": PALLAS_NATIVE, "tokamax": TOKAMAX_GMM_KERNEL},
        "auto is tokamax on GPU and ragged_dot elsewhere; Pallas Megablox is a TPU kernel, "
        "interpreted elsewhere; tokamax without a kernel for the backend runs ragged_dot",
    ),
}


def _kernel_twins(key: str, values: list[Any], backend: str) -> dict[Any, Any]:
    """value -> the value it runs as on `backend`, for values that are not themselves there."""
    reference, resolve, native, _ = KERNEL_CHOICES[key]
    twins = {}
    for value in values:
        runs_as = resolve(value, backend)
        if runs_as in native and backend not in native[runs_as]:
            runs_as = reference
        if runs_as != value:
            twins[value] = runs_as
    return twins


def _fp8_experts_possible(space: Space) -> bool:
    """Whether some trial of the space may quantize the MoE experts (fp8, targets
    dense+moe): `auto` then resolves trial by trial (on GPU, ragged_dot for fp8 experts)."""
    base = space.base_trial().get("precision", {})

    def values(key: str) -> list[Any]:
        knob = space.knobs.get(f"precision.{key}")
        default = PrecisionConfig.model_fields[key].default
        return knob.values if knob and knob.values else [base.get(key, default)]

    return "fp8" in values("mode") and "dense+moe" in values("targets")


def _drop(knob: Knob, inert: set[Any], twin_of: dict[Any, Any]) -> Knob:
    kept: list[Any] = []
    for value in knob.values or []:
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
        elif key in KERNEL_CHOICES and knob.values:
            twins = _kernel_twins(key, knob.values, backend)
            if key == "kernels.moe_gmm" and _fp8_experts_possible(space):
                twins.pop("auto", None)  # it resolves per trial: ragged_dot for fp8 experts
            kept = _drop(knob, set(twins), twins)
            if kept.values != knob.values:
                knobs[key] = kept
                notes.append(
                    f"{key}: {list(twins)} pinned to {kept.values} on {backend} (they run as "
                    f"{twins}: {KERNEL_CHOICES[key][3]})"
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
        elif key.startswith("kernels.tokamax_tiles."):
            knobs[key], first = _pin_first(knob)
            notes.append(
                f"{key}: pinned to {first!r} on {backend} (inert there: they tile tokamax's TPU "
                "grouped-matmul kernels, which run on TPU only)"
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


def program_verdicts(frame: Any) -> list[str]:
    """Knobs of a MaxText sweep judged by the programs its compiled trials became (MaxText
    takes its settings as set and says nothing of their effect): two ok trials that differ in
    one knob only and compile to the same program show that knob inert between its two
    values there; different programs, active. One line per knob and pair of values."""
    from sweeper.results import knob_columns

    needed = {"program", "status", "program_fingerprint"}
    if not needed <= set(frame.columns) or not (frame["program"] == "maxtext").any():
        return []
    ok = frame[(frame["status"] == "ok") & frame["program_fingerprint"].notna()]
    columns = list(knob_columns(frame.columns))
    pairs: dict[tuple[str, str, str], dict[bool, list[str]]] = {}
    rows = [(r["trial_id"], {c: str(r[c]) for c in columns}, r["program_fingerprint"])
            for _, r in ok.iterrows()]  # fmt: skip
    for i, (first, point, program) in enumerate(rows):
        for second, other, other_program in rows[i + 1 :]:
            differ = [c for c in columns if point[c] != other[c]]
            if len(differ) != 1:
                continue
            (column,) = differ
            low, high = sorted((point[column], other[column]))
            seen = pairs.setdefault((column, low, high), {True: [], False: []})
            seen[program == other_program].append(f"{first}/{second}")
    notes = []
    for (column, low, high), seen in sorted(pairs.items()):
        knob = column.removeprefix("knob:")
        if seen[False]:
            notes.append(f"{knob} {low} vs {high}: active (changes MaxText's program: trials "
                         f"{', '.join(seen[False])})")  # fmt: skip
        if seen[True]:
            notes.append(f"{knob} {low} vs {high}: inert (the same MaxText program: trials "
                         f"{', '.join(seen[True])})")  # fmt: skip
    return notes
