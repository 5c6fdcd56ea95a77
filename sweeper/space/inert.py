"""Knob values that have no effect on the sweep's target are pinned away before sampling.

A trial spent on an inert value measures its twin again and records a difference that
does not exist; so such values are dropped from the space, and the sweep says so.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from sweeper.space.points import in_words, listed
from sweeper.space.schema import Knob, Space
from trainer.trial.config import KernelsConfig, PrecisionConfig
from trainer.trial.effects import (
    CUDNN,
    FP8_EMULATED,
    NO_HOST_OFFLOAD,
    PALLAS_NATIVE,
    TOKAMAX_GMM_KERNEL,
)
from trainer.trial.hardware import Backend
from trainer.trial.remat import OFFLOAD_TWINS

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
        lambda v, b: KernelsConfig(attention=v).resolved_attention(Backend(b)),
        {"splash": PALLAS_NATIVE, "cudnn": CUDNN},
        "Pallas Splash is a TPU kernel, interpreted elsewhere; cuDNN runs on NVIDIA GPUs only",
    ),
    "kernels.moe_gmm": (
        "ragged_dot",
        lambda v, b: KernelsConfig(moe_gmm=v).resolved_moe_gmm(Backend(b)),
        {"megablox": PALLAS_NATIVE, "tokamax": TOKAMAX_GMM_KERNEL},
        "auto is tokamax on GPU and ragged_dot elsewhere; Pallas Megablox is a TPU kernel, "
        "interpreted elsewhere; tokamax without a kernel for the backend runs ragged_dot",
    ),
}


def _kernel_twins(key: str, values: list[Any], backend: Backend) -> dict[Any, Any]:
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


def pin_inert(space: Space, backend: Backend | None = None) -> tuple[Space, list[str]]:
    """The space with values that are inert (or only emulated) on the backend its trials run
    on removed, and a note for each. TPU trials keep every value."""
    backend = backend or space.default_backend
    space, notes = _boundary_twin(space)
    if backend == Backend.TPU:
        return space, notes
    knobs = dict(space.knobs)
    for key in sorted(space.knobs, key=lambda k: k != "remat.policy"):  # its note first
        pinned = _pinned(space, key, space.knobs[key], backend)
        if pinned is not None:
            knobs[key], note = pinned
            notes.append(note)
    return space.model_copy(update={"knobs": knobs}), notes


BOUNDARY = "remat.custom.decoder_layer_input"


def _boundary_twin(space: Space) -> tuple[Space, list[str]]:
    """The layer's input placed `remat` is the same program as placed `device` on every
    backend: it is the layer checkpoint's input, which nothing recomputes (compiled for TPU7x:
    trainer.estimate.analytic._placed). Its `remat` value, and a warm start's, become
    `device`."""
    knob = space.knobs.get(BOUNDARY)
    if knob is None or not knob.values or "remat" not in knob.values:
        return space, []
    starts = [
        {**p, BOUNDARY: "device"} if p.get(BOUNDARY) == "remat" else p
        for p in space.search.warm_start
    ]
    search = space.search.model_copy(update={"warm_start": starts})
    knobs = {**space.knobs, BOUNDARY: _drop(knob, {"remat"}, {"remat": "device"})}
    return space.model_copy(update={"knobs": knobs, "search": search}), [
        f"{BOUNDARY}: 'remat' is the same program as 'device' (the layer's input is its "
        "checkpoint's input, kept on device); not sampled"
    ]


def _pinned(space: Space, key: str, knob: Knob, backend: Backend) -> tuple[Knob, str] | None:
    """The knob with its values inert on `backend` pinned away, and the note that says so;
    None when every value acts there."""
    if key == "remat.policy" and knob.values and backend in NO_HOST_OFFLOAD:
        inert = {v for v in knob.values if v in OFFLOAD_TWINS}
        if not inert:
            return None
        return _drop(knob, inert, OFFLOAD_TWINS), (
            f"remat.policy: {listed(sorted(inert))} "
            + (
                f"is inert on {backend} (host offload is dropped; it compiles to its remat twin "
                if len(inert) == 1
                else f"are inert on {backend} (host offload is dropped; they compile to their "
                "remat twins "
            )
            + f"{listed(OFFLOAD_TWINS[v] for v in sorted(inert))}); not sampled"
        )
    if (
        key.startswith("remat.custom.")
        and knob.values
        and "offload" in knob.values
        and backend in NO_HOST_OFFLOAD
    ):
        twin = "device" if key == BOUNDARY else "remat"  # the layer input stays on device
        return _drop(knob, {"offload"}, {"offload": twin}), (
            f"{key}: 'offload' is inert on {backend} (same program as '{twin}'); not sampled"
        )
    if key in KERNEL_CHOICES and knob.values:
        twins = _kernel_twins(key, knob.values, backend)
        if key == "kernels.moe_gmm" and _fp8_experts_possible(space):
            twins.pop("auto", None)  # it resolves per trial: ragged_dot for fp8 experts
        kept = _drop(knob, set(twins), twins)
        if kept.values == knob.values:
            return None
        return kept, (
            f"{key}: {listed(twins)} pinned to {listed(kept.values or [])} on {backend} ("
            + "; ".join(f"{value} runs as {twin}" for value, twin in twins.items())
            + f": {KERNEL_CHOICES[key][3]})"
        )
    if key in THROUGHPUT_MEANINGLESS and knob.values:
        keep, backends, reason = THROUGHPUT_MEANINGLESS[key]
        dropped = [v for v in knob.values if v != keep]
        if not dropped or backend not in backends:
            return None
        return knob.model_copy(update={"values": [keep]}), (
            f"{key}: {listed(dropped)} pinned to {in_words(keep)} on {backend} "
            f"({reason.format(b=backend)})"
        )
    return _pinned_tpu_only(key, knob, backend)


def _pinned_tpu_only(key: str, knob: Knob, backend: Backend) -> tuple[Knob, str] | None:
    """LIBTPU flags and TPU kernel tiles: pinned to their first value off TPU."""
    if key.startswith("xla."):
        why = f"LIBTPU flags do not reach the {backend} backend"
    elif key.startswith("kernels.block_") or key.startswith("kernels.gmm_t"):
        why = "TPU kernels are interpreted there: tiles have no speed meaning"
    elif key.startswith("kernels.tokamax_tiles."):
        why = "inert there: they tile tokamax's TPU grouped-matmul kernels, which run on TPU only"
    else:
        return None
    pinned, first = _pin_first(knob)
    return pinned, f"{key}: pinned to {in_words(first)} on {backend} ({why})"
