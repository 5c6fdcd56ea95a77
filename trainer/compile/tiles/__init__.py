"""Kernel tiles tuned per kernel at compile fidelity (`kernels.tune: compile`).

Each tunable kernel of a trial's program is compiled alone, at the trial's per-device shapes
and dtypes under the trial's libtpu flags (its scoped VMEM limit among them, or a limit given
to the tuner), for one device of the target, once for each candidate: Splash's forward and
fused dK/dV backward (the trial's blocks, and blocks of 512 to 4096 rows: query blocks that
divide a device's queries, key blocks that divide the sequence; under context parallelism one
device's query chunk against every key), tokamax's grouped matmuls for each expert weight, forward, input gradient
and weight gradient (the trial's tiles, and 256-1024 rows by 512-2048 contraction and
columns, clamped to the pass), and Megablox's one tiling for every pass of both weights
(128-1024 rows that divide the routed rows by 512-2048). A candidate the compiler refuses (a scoped-VMEM overflow, a
Mosaic error) is dropped with the compiler's words; each that compiles is priced by the step
model as the trial's program would run it (its FLOPs over the MXU share its tiles fill, at
least one grid step's time a step: `calls_seconds`), and the trial runs with the lowest of
each kernel.

A family's kernels compile in one program, the i-th candidate of each together, and are
priced apart; a compile the compiler refuses names the kernel it refused, and the others are
compiled again beside a tile of it that compiles. Results are kept by the kernels' shapes,
layouts, flags, VMEM limit, target and compiler (`TILES_DIR` of the sweep's cache): a second
trial with the same kernels reads them instead of compiling.
"""

from trainer.compile.tiles.families import gmm_candidates, splash_candidates
from trainer.compile.tiles.record import Tried, Tuned, Tuning
from trainer.compile.tiles.search import TILES_DIR, as_json, tune

__all__ = ["TILES_DIR", "Tried", "Tuned", "Tuning", "as_json", "gmm_candidates",
           "splash_candidates", "tune"]  # fmt: skip
