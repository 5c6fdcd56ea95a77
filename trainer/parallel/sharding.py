"""Mesh construction and every logical-axis rule, in one place."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax
from jax.experimental import mesh_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from trainer.trial.config import BATCH_AXES, MESH_AXES, ConfigError

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


def build_mesh(degrees: dict[str, int], devices: Sequence[jax.Device]) -> Mesh:
    """The mesh laid on the physical topology: `mesh_utils` places the innermost axes
    (tensor, then expert, context) on nearest neighbours of the torus; with several slices,
    `data` spans them (DCN) and every other axis stays inside a slice (ICI)."""
    shape = tuple(degrees[axis] for axis in MESH_AXES)
    slices = sorted({getattr(d, "slice_index", 0) for d in devices})
    if len(slices) > 1:
        if degrees["data"] % len(slices):
            raise ConfigError(
                "mesh.data",
                f"{degrees['data']} must be a multiple of the {len(slices)} slices: data "
                "parallelism is the axis that crosses slices (DCN)",
            )
        dcn = (len(slices),) + (1,) * (len(shape) - 1)
        ici = (degrees["data"] // len(slices), *shape[1:])
        grid = mesh_utils.create_hybrid_device_mesh(ici, dcn, devices)
    else:
        grid = mesh_utils.create_device_mesh(shape, devices, allow_split_physical_axes=True)
    return Mesh(grid, MESH_AXES)


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
