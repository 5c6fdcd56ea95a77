"""Knob values that have no effect on the sweep's target are pinned away before sampling.

A trial spent on an inert value measures its twin again and records a difference that
does not exist; so such values are dropped from the space, and the sweep says so.
"""

from __future__ import annotations

from sweeper.space import Knob, Space

# Offload policies and their remat twins (what they compile to when host placement is dropped).
OFFLOAD_TWINS = {"qkv_proj_offloaded": "save_qkv_proj", "minimal_offloaded": "minimal"}


def target_backend(space: Space) -> str:
    return "cpu" if space.target == "local" else space.target.split(":")[0]


def _drop(knob: Knob, inert: set, twin_of: dict) -> Knob:
    kept: list = []
    for value in knob.values:
        replacement = twin_of.get(value, value) if value in inert else value
        if replacement not in kept:
            kept.append(replacement)
    return knob.model_copy(update={"values": kept})


def pin_inert(space: Space) -> tuple[Space, list[str]]:
    """The space with inert values removed on its target backend, and a note for each."""
    if target_backend(space) != "cpu":
        return space, []
    notes, knobs = [], dict(space.knobs)
    policy = knobs.get("remat.policy")
    if policy and policy.values:
        inert = {v for v in policy.values if v in OFFLOAD_TWINS}
        if inert:
            knobs["remat.policy"] = _drop(policy, inert, OFFLOAD_TWINS)
            notes.append(
                f"remat.policy: {sorted(inert)} are inert on cpu (host offload is dropped; they compile to "
                f"their remat twins {[OFFLOAD_TWINS[v] for v in sorted(inert)]}); not sampled"
            )
    for key, knob in space.knobs.items():
        if key.startswith("remat.custom.") and knob.values and "offload" in knob.values:
            knobs[key] = _drop(knob, {"offload"}, {"offload": "remat"})
            notes.append(f"{key}: 'offload' is inert on cpu (same program as 'remat'); not sampled")
    return space.model_copy(update={"knobs": knobs}), notes
