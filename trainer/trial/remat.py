"""Rematerialization: the tensors a decoder layer names, the policies over them, and the
`remat` knob. The one table: the model tags its tensors with `Tensor`, the config validates
names and placements against it, the trainer builds jax.checkpoint policies from it, the
estimate reads its recompute share and the engine its offload twins. JAX-free.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Literal

from pydantic import Field, model_validator

from trainer.trial.schema import Frozen


class Tensor(StrEnum):
    """A tensor a decoder layer names (`jax.ad_checkpoint.checkpoint_name`), as MaxText names it."""

    DECODER_LAYER_INPUT = "decoder_layer_input"  # the checkpoint boundary
    CONTEXT = "context"  # attention's output (Splash: with its log-sum-exp)
    QUERY_PROJ = "query_proj"  # queries, RoPE applied
    KEY_PROJ = "key_proj"
    VALUE_PROJ = "value_proj"
    QKV_PROJ = "qkv_proj"  # the fused projection (model.fused_qkv)
    OUT_PROJ = "out_proj"
    MLPWI_0 = "mlpwi_0"  # the gate projection
    MLPWI_1 = "mlpwi_1"  # the up projection
    MLPWO = "mlpwo"


# An MoE layer's expert tensors answer to their dense name and to `moe_` + it, as in MaxText.
EXPERT_TENSORS = (Tensor.MLPWI_0, Tensor.MLPWI_1, Tensor.MLPWO)


def moe_twin(tensor: Tensor) -> str:
    return f"moe_{tensor.value}"


# Tensor names a `custom` policy may place; everything not placed is recomputed.
CUSTOM_TENSORS = (*(t.value for t in Tensor), *(moe_twin(t) for t in EXPERT_TENSORS))


@dataclass(frozen=True)
class Policy:
    """Saved: kept on device; offloaded: moved to pinned host memory; the rest recomputed."""

    saved: tuple[Tensor, ...]
    offloaded: tuple[Tensor, ...] = ()

    @property
    def remat_twin(self) -> tuple[Tensor, ...]:
        """What the policy keeps where host placement is dropped: its saved and offloaded."""
        return (*self.saved, *self.offloaded)


_QKV = (Tensor.QUERY_PROJ, Tensor.KEY_PROJ, Tensor.VALUE_PROJ, Tensor.QKV_PROJ)
_MINIMAL = (*_QKV, Tensor.OUT_PROJ, *EXPERT_TENSORS)

POLICIES: dict[str, Policy] = {
    "full": Policy(()),
    "minimal": Policy(_MINIMAL),
    "minimal_with_context": Policy((*_MINIMAL, Tensor.CONTEXT)),
    "save_dot_with_context_except_mlp": Policy((*_QKV, Tensor.CONTEXT, Tensor.OUT_PROJ)),
    "save_dot_except_mlpwi": Policy((*_QKV, Tensor.OUT_PROJ, Tensor.MLPWO)),
    "save_dot_except_mlp": Policy((*_QKV, Tensor.OUT_PROJ)),
    "save_qkv_proj": Policy(_QKV),
    "save_out_proj": Policy((Tensor.OUT_PROJ,)),
    "qkv_proj_offloaded": Policy((), offloaded=_QKV),
    "minimal_offloaded": Policy((), offloaded=_MINIMAL),
    # Per-tensor placements (RematConfig.custom): what they do not keep is recomputed.
    "custom": Policy(()),
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

RematPolicy = Literal[REMAT_POLICIES]  # type: ignore[valid-type]
Placement = Literal["device", "remat", "offload"]


class RematConfig(Frozen):
    policy: RematPolicy = "full"
    """which activations are kept, offloaded to host or recomputed in the backward pass (trainer.trial.remat)."""
    custom: dict[str, Placement] = Field(default_factory=dict)
    """policy custom only: tensor name -> device (keep), offload (pinned host) or remat (recompute)."""

    @model_validator(mode="after")
    def _check(self) -> RematConfig:
        if self.custom and self.policy != "custom":
            raise ValueError("custom: per-tensor placements are only read when policy is 'custom'")
        unknown = sorted(set(self.custom) - set(CUSTOM_TENSORS))
        if unknown:
            raise ValueError(
                f"custom: unknown tensor(s) {unknown}; known: {', '.join(CUSTOM_TENSORS)}"
            )
        return self


def placements(remat: RematConfig) -> dict[str, tuple[str, ...]]:
    """Tensor names kept on device and offloaded to host; everything else is recomputed."""
    if remat.policy == "custom":
        device = tuple(n for n, p in remat.custom.items() if p == "device")
        offload = tuple(n for n, p in remat.custom.items() if p == "offload")
        # decoder_layer_input is the checkpoint boundary and saved unless placed otherwise.
        if Tensor.DECODER_LAYER_INPUT not in remat.custom:
            device = (Tensor.DECODER_LAYER_INPUT.value, *device)
        return {"device": device, "offload": offload}
    policy = POLICIES[remat.policy]
    return {
        "device": tuple(t.value for t in policy.saved),
        "offload": tuple(t.value for t in policy.offloaded),
    }


def uses_offload(remat: RematConfig) -> bool:
    return bool(placements(remat)["offload"])


def on_device(remat: RematConfig) -> RematConfig:
    """The same policy with what it offloads kept on device instead (the twin an offload
    policy is judged against: it saves only if it lowers device memory below this)."""
    if remat.policy == "custom":
        custom = {n: "device" if p == "offload" else p for n, p in remat.custom.items()}
        return remat.model_copy(update={"custom": custom})
    return remat.model_copy(update={"policy": OFFLOAD_TWINS.get(remat.policy, remat.policy)})
