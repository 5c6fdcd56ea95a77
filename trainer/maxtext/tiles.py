"""`kernels.tune: compile` in a MaxText trial. Splash's blocks are MaxText's `sa_block_*`
settings, so the engine's tuner (trainer/compile/tiles/) tunes them at the trial's per-device
shapes under its scoped VMEM limit before MaxText compiles, and MaxText's train_compile
compiles the trial with the blocks it chose (its program's Splash calls carry them).

The candidates are compiled as tokamax's Splash, MaxText's kernel with use_tokamax_splash;
without it MaxText runs JAX's Splash, the kernel tokamax's was forked from, with the same
blocks: MaxText's compile of the trial is the check that they fit there too. Not tuned: the
experts' grouped matmuls (MaxText 0.2.5's tokamax path passes no tiles; its Megablox takes a
tiling per weight and pass where a trial maps one), and Splash in a model whose attention the
trial's shape does not describe (sliding windows, a global head width, sinks, MLA: the
recipe's features `sweeper import` found unmodeled), whose kernels are other shapes.
"""

from __future__ import annotations

from typing import Any

from trainer.trial.config import TrialConfig
from trainer.trial.events import Emitter
from trainer.trial.hardware import Backend, Topology
from trainer.trial.maxtext import TOKAMAX_TILES_UNMAPPED, MaxTextProgram

# Model features (MaxText config keys, as `sweeper import` lists them unmodeled) that give
# MaxText's Splash calls other shapes than the trial's model has.
ATTENTION_FEATURES = (
    "attention_type", "q_lora_rank", "kv_lora_rank", "sliding_window_size", "global_head_dim",
    "use_sinks", "attention_sink", "inhomogeneous_layer_cycle_interval",
)  # fmt: skip
# The families of the tuner MaxText takes no tiles from, and why (a family's kind).
UNTAKEN = {
    "gmm": TOKAMAX_TILES_UNMAPPED,
    "megablox": "MaxText's Megablox takes a tiling per weight and pass (wi_tile_*, wo_tile_*) "
    "where a trial maps one tiling to the forward passes: not tuned for MaxText",
}
HOW = "tuned as tokamax's Splash, for MaxText's sa_block_* (its compile of the trial checks them)"


def tuned_for_maxtext(
    config: TrialConfig, program: MaxTextProgram, topology: Topology, emitter: Emitter | None = None
) -> tuple[TrialConfig, dict[str, dict[str, str]], dict[str, Any] | None]:
    """The trial with the Splash blocks the tuner chose (`kernels.tune: compile`), the knob's
    effect, and the tuning's record (None when the tuner did not run): our trainer's
    `tuned_blocks`, less what MaxText takes no tiles for. In a process whose environment
    trainer/cli.py prepared for libtpu, as for any compile trial."""
    if config.kernels.tune != "compile":
        return config, {}, None
    why = untunable(config, program)
    if why:
        return config, {"kernels.tune": {"status": "inert", "reason": why}}, None
    from trainer.compile.aot import topology_devices, tuned_blocks  # imports JAX and libtpu

    devices = topology_devices(topology.target)
    return tuned_blocks(config, topology, devices, UNTAKEN, HOW, emitter)


def untunable(config: TrialConfig, program: MaxTextProgram) -> str:
    """Why MaxText's program has no kernel the tuner can tune for it ("" when it has)."""
    attention = config.resolved_kernels(Backend.TPU, config.mesh.context).attention
    if attention != "splash":
        why = (
            f"MaxText takes tuned blocks for Splash alone, and the trial's attention is {attention}"
        )
        return why + (
            f"; the experts' grouped matmuls: {UNTAKEN['gmm']}" if config.model.is_moe else ""
        )
    features = attention_features(program)
    if features:
        return (f"MaxText's attention here is not the shape the tuner builds ({'; '.join(features)}"
                "): its Splash blocks run as set")  # fmt: skip
    return ""


def attention_features(program: MaxTextProgram) -> list[str]:
    """The imported recipe's model features that change its attention's shapes."""
    if program.recipe is None:
        return []
    return [u for u in program.recipe.unmodeled if u.split("=")[0] in ATTENTION_FEATURES]
