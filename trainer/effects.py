"""Which knobs really act on the backend a trial runs on; inert ones are reported, not hidden."""

from __future__ import annotations

from trainer.config import TrialConfig
from trainer.remat import uses_offload


def knob_effects(config: TrialConfig, platform: str) -> dict[str, dict[str, str]]:
    effects: dict[str, dict[str, str]] = {
        "mesh": {"status": "active", "reason": f"sharded over {platform} devices"},
        "remat.policy": {
            "status": "active",
            "reason": "changes saved tensors, memory and recompute",
        },
    }
    if uses_offload(config.remat):
        if platform == "cpu":
            effects["remat.offload"] = {
                "status": "inert",
                "reason": "the CPU backend drops host placement: offload behaves as remat",
            }
        else:
            effects["remat.offload"] = {
                "status": "active",
                "reason": "offloaded to pinned host memory",
            }
    return effects
