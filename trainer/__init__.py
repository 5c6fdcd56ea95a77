"""The JAX/Flax trainer a sweep trial runs; usable on its own as `python -m trainer`.

Its folders are its systems. Each imports only itself and the folders `LAYERS` names for
it (tests/test_layering.py holds the code to that, and to having no import cycle):

- trial/     what a trial is, with no JAX: the typed configuration and its checks, the remat
             tensor table, model presets, LIBTPU flag bundles, accelerators and topologies,
             what the MXU makes of a kernel's tiles (tokamax's own read from its source),
             knob effects, the event protocol and the typed trial result, shared files.
- estimate/  the analytic step model (formulas and a datasheet) and the planner; no JAX.
- parallel/  meshes, logical-axis rules, context-parallel load balancing, multi-host joins.
- model/     the transformer: attention and grouped-matmul kernels, MoE routing, fp8, loss.
- program/   a trial's program: built from a configuration for a list of devices, lowered,
             compiled; the train step; the one reader of compiled HLO text.
- run/       training it: data, the timed loop, metrics, the convergence check (and, on a
             TPU, compile/'s tile tuner timing the trial's kernels first).
- compile/   compile fidelity: AOT for a TPU topology, compile records, the program's counted
             cost and schedule, the step-time model read from them, and the kernel tile
             tuner (tiles/: compiled and priced, or timed on a TPU).
- maxtext/    MaxText as the trial program: MaxText's train_compile or train run in its own
             Python, what it prints read back as this trainer's events; its compiled HLO
             read by compile/'s step model.
- cli.py     `python -m trainer` on top of them all.

The engine (sweeper/) imports `JAX_FREE` folders only.
"""

# folder -> the folders it may import besides itself.
LAYERS: dict[str, frozenset[str]] = {
    "trial": frozenset(),
    "estimate": frozenset({"trial"}),
    "parallel": frozenset({"trial"}),
    "model": frozenset({"trial", "parallel"}),
    "program": frozenset({"trial", "parallel", "model"}),
    "run": frozenset({"trial", "parallel", "program", "compile"}),
    "compile": frozenset({"trial", "program", "estimate"}),
    "maxtext": frozenset({"trial", "program", "compile"}),
}
# Folders that import no JAX: all the engine may import of the trainer.
JAX_FREE = ("trial", "estimate")
