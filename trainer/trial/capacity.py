"""Expert capacity and the expert-parallel receive buffer: plain arithmetic, shared by the
routing code (trainer/model/dispatch.py) and the analytic estimate (no JAX here)."""

from __future__ import annotations

import math


def expert_capacity(slots: int, num_experts: int, factor: float) -> int | None:
    """Slots each expert accepts from one token group of `slots`; None is dropless."""
    if factor <= 0:
        return None
    return max(1, math.ceil(factor * slots / num_experts))


def receive_buffer_groups(slots: int, num_experts: int, expert_degree: int, factor: float) -> int:
    """The expert-parallel receive buffer in whole multiples of a device's `slots` (so a GMM
    row tile dividing the slots divides the buffer): every peer's kept slots for this shard's
    experts at worst, that is `expert_degree` dropless, about `factor` with a capacity."""
    capacity = expert_capacity(slots, num_experts, factor)
    if capacity is None:
        return expert_degree
    return min(expert_degree, math.ceil(num_experts * capacity / slots))
