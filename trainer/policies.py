"""Remat policies (KNOBS.md): what each keeps on device, offloads to host, and recomputes.

The one table of them, JAX-free: the config validates names against it, the trainer builds
jax.checkpoint policies from it, the estimate reads its recompute share and the engine its
offload twins.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from trainer.config import RematConfig

_QKV = ("query_proj", "key_proj", "value_proj", "qkv_proj")
_MINIMAL = (*_QKV, "out_proj", "mlpwi_0", "mlpwi_1", "mlpwi", "mlpwo")


@dataclass(frozen=True)
class Policy:
    """Saved: kept on device; offloaded: moved to pinned host memory; the rest recomputed."""

    saved: tuple[str, ...]
    offloaded: tuple[str, ...] = ()
    # Share of the forward pass recomputed in the backward pass (the estimate's figure).
    recompute_share: float = 0.0

    @property
    def remat_twin(self) -> tuple[str, ...]:
        """What the policy keeps where host placement is dropped: its saved and offloaded."""
        return (*self.saved, *self.offloaded)


POLICIES: dict[str, Policy] = {
    "full": Policy((), recompute_share=1.0),
    "minimal": Policy(_MINIMAL, recompute_share=0.15),
    "minimal_with_context": Policy((*_MINIMAL, "context"), recompute_share=0.1),
    "save_dot_with_context_except_mlp": Policy((*_QKV, "context", "out_proj"), recompute_share=0.6),
    "save_dot_except_mlpwi": Policy((*_QKV, "out_proj", "mlpwo"), recompute_share=0.45),
    "save_dot_except_mlp": Policy((*_QKV, "out_proj"), recompute_share=0.65),
    "save_qkv_proj": Policy(_QKV, recompute_share=0.75),
    "save_out_proj": Policy(("out_proj",), recompute_share=0.9),
    "qkv_proj_offloaded": Policy((), offloaded=_QKV, recompute_share=0.75),
    "minimal_offloaded": Policy((), offloaded=_MINIMAL, recompute_share=0.15),
    # Per-tensor placements (RematConfig.custom); half recomputed is the estimate's prior.
    "custom": Policy((), recompute_share=0.5),
}
REMAT_POLICIES = tuple(POLICIES)
# Offload policies and the policy they compile to when host placement is dropped.
OFFLOAD_TWINS = {
    name: twin
    for name, policy in POLICIES.items()
    if policy.offloaded
    for twin, other in POLICIES.items()
    if not other.offloaded and other.saved == policy.remat_twin
}


def placements(remat: RematConfig) -> dict[str, tuple[str, ...]]:
    """Tensor names kept on device and offloaded to host; everything else is recomputed."""
    if remat.policy == "custom":
        device = tuple(n for n, p in remat.custom.items() if p == "device")
        offload = tuple(n for n, p in remat.custom.items() if p == "offload")
        # decoder_layer_input is the checkpoint boundary and saved unless placed otherwise.
        if "decoder_layer_input" not in remat.custom:
            device = ("decoder_layer_input", *device)
        return {"device": device, "offload": offload}
    policy = POLICIES[remat.policy]
    return {"device": policy.saved, "offload": policy.offloaded}


def uses_offload(remat: RematConfig) -> bool:
    return bool(placements(remat)["offload"])


def on_device(remat: RematConfig) -> RematConfig:
    """The same policy with what it offloads kept on device instead (the twin an offload
    policy is judged against: it saves only if it lowers device memory below this)."""
    if remat.policy == "custom":
        custom = {n: "device" if p == "offload" else p for n, p in remat.custom.items()}
        return remat.model_copy(update={"custom": custom})
    return remat.model_copy(update={"policy": OFFLOAD_TWINS.get(remat.policy, remat.policy)})
