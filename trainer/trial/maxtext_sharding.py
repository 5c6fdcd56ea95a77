"""Which meshes MaxText 0.2.5 can shard a model over: JAX refuses a weight whose sharded axis
the mesh's degrees do not divide (`IndivisibleError`, after a minute of tracing), so a trial
whose mesh cannot shard its model is refused before MaxText starts. The mesh is MaxText's own,
read from the trial's settings (`ici_*` within a slice, `dcn_*` across slices). JAX-free."""

from __future__ import annotations

import math

from trainer.trial.config import ConfigError, TrialConfig

# MaxText 0.2.5's base.yml, logical_axis_rules: every weight's embedding axis ('embed') is
# sharded over fsdp, fsdp_transpose, context, context_usp_ulysses and expert.
EMBED_AXES = ("fsdp", "context", "expert")
MESH_AXES = ("data", "fsdp", "context", "expert", "tensor")
# Its mesh axes as its settings name them (`ici_<axis>_parallelism`, `dcn_...`: pipeline is
# its mesh's stage), each taking its share of the devices.
MAXTEXT_AXES = ("diloco", "data", "pipeline", "fsdp", "fsdp_transpose", "sequence", "context",
                "context_usp_ulysses", "context_autoregressive", "tensor", "tensor_sequence",
                "expert", "autoregressive")  # fmt: skip
# Those of its axes that shard the embedding axis as one of ours does, read as that one.
FOLDED = {"fsdp_transpose": "fsdp", "context_usp_ulysses": "context"}
# base.yml's defaults: within a slice fsdp fills what the others leave; across slices, data.
ICI_DEFAULTS = {"fsdp": -1}
DCN_DEFAULTS = {"data": -1}


def maxtext_degrees(args: dict[str, str], devices: int, slices: int = 1) -> dict[str, int]:
    """MaxText's mesh degree of each of the engine's axes (within a slice times across slices)
    for its settings `args` on `devices` devices in `slices` slices (-1: what the others
    leave), MaxText's other axes that shard the weights as one of ours (FOLDED) in it."""
    ici = _filled(args, "ici", ICI_DEFAULTS, devices // slices)
    dcn = _filled(args, "dcn", DCN_DEFAULTS, slices)
    degrees = {axis: ici[axis] * dcn[axis] for axis in MAXTEXT_AXES}
    for theirs, ours in FOLDED.items():
        degrees[ours] *= degrees[theirs]
    return {axis: degrees[axis] for axis in MESH_AXES}


def _filled(
    args: dict[str, str], scope: str, defaults: dict[str, int], size: int
) -> dict[str, int]:
    given = {a: int(float(args.get(f"{scope}_{a}_parallelism", defaults.get(a, 1))))
             for a in MAXTEXT_AXES}  # fmt: skip
    fixed = math.prod(d for d in given.values() if d > 0)
    return {a: max(size // fixed, 1) if d < 0 else d for a, d in given.items()}


def check_shardable(config: TrialConfig, degrees: dict[str, int]) -> None:
    """Refuse a mesh whose fsdp x context x expert does not divide the model's width: MaxText
    shards every weight's embedding axis over them. The fix names the largest fsdp that does."""
    shards = math.prod(degrees[axis] for axis in EMBED_AXES)
    width = config.model.d_model
    if width % shards == 0:
        return
    others = shards // degrees["fsdp"]
    fits = [d for d in range(degrees["fsdp"], 0, -1)
            if degrees["fsdp"] % d == 0 and width % (d * others) == 0]  # fmt: skip
    said = (
        f"MaxText shards every weight's embedding axis (d_model {width}) over fsdp x context x "
        f"expert = {degrees['fsdp']} x {degrees['context']} x {degrees['expert']} = {shards} "
        f"(its base.yml's logical axis rule 'embed'), which does not divide {width}: JAX "
        "refuses such a weight."
    )
    if not fits:
        raise ConfigError(
            "mesh.expert" if degrees["expert"] > 1 else "mesh.context",
            f"{said} Take a context x expert ({others}) that divides it",
        )
    fsdp, rest = fits[0], degrees["fsdp"] // fits[0]
    settings = (
        f"ici_fsdp_parallelism={fsdp} ici_data_parallelism={rest}"
        if degrees["data"] == 1
        else f"ici_fsdp_parallelism={fsdp}, and {rest} times the data parallelism"
    )
    raise ConfigError(
        "mesh.fsdp", f"{said} Take fsdp {fsdp} and the other {rest} as data ({settings})"
    )
