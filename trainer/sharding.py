"""Mesh construction and every logical-axis rule, in one place."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from trainer.config import MESH_AXES, ConfigError, TrialConfig

# Order matters: flax takes the first rule whose mesh axes are still free in a given spec,
# so expert weights (exp -> expert) fall back to embed -> (fsdp, context).
LOGICAL_RULES: tuple[tuple[str, Any], ...] = (
    ("activation_batch", ("data", "fsdp", "expert")),
    ("activation_length", "context"),
    ("activation_heads", "tensor"),
    ("activation_kv_heads", "tensor"),
    ("activation_mlp", "tensor"),
    ("activation_vocab", "tensor"),
    ("exp", "expert"),
    ("vocab", "tensor"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("mlp", "tensor"),
    ("embed", ("fsdp", "context", "expert")),
    ("embed", ("fsdp", "context")),
    ("embed", "fsdp"),
)
BATCH_AXES = ("data", "fsdp", "expert")


def build_mesh(degrees: dict[str, int], devices: Sequence[jax.Device]) -> Mesh:
    shape = tuple(degrees[axis] for axis in MESH_AXES)
    return Mesh(np.asarray(devices).reshape(shape), MESH_AXES)


def global_batch_size(config: TrialConfig, num_devices: int) -> int:
    global_batch = config.per_device_batch * num_devices
    if abs(global_batch - round(global_batch)) > 1e-9:
        raise ConfigError(
            "per_device_batch",
            f"{config.per_device_batch} x {num_devices} devices = {global_batch} is not a whole batch",
        )
    return round(global_batch)


def check_batch_and_sequence(
    config: TrialConfig, degrees: dict[str, int], num_devices: int
) -> None:
    """Static divisibility checks that need only the resolved mesh degrees."""
    global_batch = global_batch_size(config, num_devices)
    batch_shards = math.prod(degrees[a] for a in BATCH_AXES)
    if global_batch % batch_shards:
        raise ConfigError(
            "per_device_batch",
            f"global batch {global_batch} is not divisible by data x fsdp x expert = {batch_shards}; "
            "raise per_device_batch or move degree to context/tensor",
        )
    chunks = degrees["context"] * (
        2 if config.mesh.context_load_balance and degrees["context"] > 1 else 1
    )
    if config.seq_len % chunks:
        what = "2 x context (load balancing)" if chunks != degrees["context"] else "context"
        raise ConfigError("seq_len", f"{config.seq_len} is not divisible by {what} = {chunks}")


def state_shardings(abstract_boxed_state: Any, mesh: Mesh) -> Any:
    """NamedShardings for a state tree whose leaves carry flax logical partitioning."""
    specs = nn.get_partition_spec(abstract_boxed_state)
    return nn.logical_to_mesh_sharding(specs, mesh, LOGICAL_RULES)


def check_divisible(abstract_state: Any, shardings: Any, mesh: Mesh) -> None:
    """Reject a mesh that would shard a parameter dimension unevenly, naming the parameter."""
    leaves, _ = jax.tree_util.tree_flatten_with_path(abstract_state)
    sharding_leaves = jax.tree_util.tree_leaves(
        shardings, is_leaf=lambda x: isinstance(x, NamedSharding)
    )
    for (path, leaf), sharding in zip(leaves, sharding_leaves, strict=True):
        for dim, axes in enumerate(sharding.spec):
            if axes is None:
                continue
            names = (axes,) if isinstance(axes, str) else tuple(axes)
            shards = math.prod(mesh.shape[a] for a in names)
            if leaf.shape[dim] % shards:
                where = jax.tree_util.keystr(path)
                raise ConfigError(
                    "mesh",
                    f"parameter {where} dimension {dim} has size {leaf.shape[dim]}, "
                    f"not divisible by mesh axes {names} = {shards}",
                )


def batch_sharding(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec(BATCH_AXES, "context"))
