"""The kernels a trial's tiles are tuned for, in families compiled together: Splash's forward
and fused dK/dV backward in one attention layer; each expert weight's (wi, wo) three
grouped matmuls (forward, input gradient, weight gradient) in one MoE matmul. A family knows
its kernels' per-device shapes, their candidate tiles (the trial's own first), how to compile
one program of them for a device, and which kernel a compiled call (or a refusal) is."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import jax

from trainer.compile.cost import program_cost
from trainer.compile.tiles.record import settings_of
from trainer.program.hlo import parse
from trainer.program.kernels import (
    Layer,
    compiled_hlo,
    gmm_layer,
    gmm_tiles,
    megablox_layer,
    splash_layer,
)
from trainer.trial.config import GMM_PASSES, TrialConfig
from trainer.trial.hardware import Backend

Blocks = tuple[int, ...]
# A kernel alone is named for the transforms around it (Megablox's gmm under a VJP:
# transpose_jvp_jit_gmm___.lhs); in the trial's program it is gmm, as the step model reads it.
_SCOPED = re.compile(r"^(?:transpose_)?(?:jvp_)?jit_([a-z]+)_+(?:\..*)?$")

# Splash: its kernels, the block fields each takes, and how each is named in a compiled
# program (and in the compiler's refusals).
SPLASH = {
    "splash forward": ("block_q", "block_kv", "block_kv_compute"),
    "splash backward": ("block_q_dkv", "block_kv_dkv", "block_kv_dkv_compute"),
}
SPLASH_NAMES = {"splash forward": "splash_mqa_fwd", "splash backward": "splash_mqa_dkv"}
SPLASH_SIZES = (512, 1024, 2048, 4096)
# tokamax's TPU grouped matmul: each pass's kernel as a compiled program names it (the
# longest first: "gmm" is in the other two), and the tile sizes tried (rows; contraction
# and output columns), each at most the pass's dim.
GMM_NAMES = {
    "drhs": "ragged_dot_tgmm",
    "dlhs": "ragged_dot_gmm_transpose_rhs",
    "fwd": "ragged_dot_gmm",
}
GMM_ROWS = (256, 512, 1024)
GMM_COLUMNS = (512, 1024, 2048)
# Megablox: one (tm, tk, tn) for every pass of both weights; tm must divide the routed rows.
MEGABLOX = {"megablox": ("gmm_tm", "gmm_tk", "gmm_tn")}
MEGABLOX_ROWS = (128, 256, 512, 1024)


@dataclass
class Family:
    """Kernels compiled together: each one's settings (`knobs`), the trial's tiles
    (`given`), the candidates (`listed`, the given first), what identifies their programs
    besides the tiles (`identity`), how each is named in a compiled program (`names`), and
    their program (`layer`: a trial config's, of one `part`; `whole` runs every kernel,
    `parts[kernel]` what a kernel's timing runs), compiled for `device`."""

    name: str
    knobs: Mapping[str, tuple[str, ...]]
    given: Mapping[str, Blocks]
    listed: Mapping[str, list[Blocks]]
    identity: dict[str, Any]
    names: dict[str, str]
    layer: Callable[[TrialConfig, str], Layer]
    whole: str
    parts: dict[str, str]
    device: Any

    @property
    def kind(self) -> str:
        """splash, megablox or gmm (of either weight)."""
        return self.name.split()[0]

    def owner(self, text: str) -> str | None:
        """The kernel a call name (or a compiler's refusal) names, if one."""
        return next((k for k, n in self.names.items() if n in text), None)

    def trial(self, config: TrialConfig, pick: Mapping[str, Blocks]) -> TrialConfig:
        """`config` running `pick`'s tiles for these kernels."""
        settings: dict[str, int | str] = {}
        for kernel, blocks in pick.items():
            settings.update(settings_of(self.knobs[kernel], blocks))
        return config.model_copy(update={"kernels": config.kernels.tuned(settings)})

    def calls(self, trial: TrialConfig, options: dict[str, Any] | None) -> list[dict]:
        """The kernel calls of the whole program of `trial` compiled under `options`."""
        hlo = compiled_hlo(self.layer(trial, self.whole), self.device, options)
        calls = program_cost(parse(hlo))["kernel_calls"]
        return [{**c, "name": _SCOPED.sub(r"\1", c["name"])} for c in calls]


def splash_candidates(seq: int, given: Blocks, queries: int | None = None) -> list[Blocks]:
    """The trial's blocks first, then query blocks that divide a device's queries (`queries`:
    seq / context under context parallelism) by key blocks that divide the sequence."""

    def dividing(n: int) -> list[int]:
        return [s for s in SPLASH_SIZES if s <= n and n % s == 0]

    square = [(q, kv, kv) for q in dividing(queries or seq) for kv in dividing(seq)]
    return [given, *(c for c in square if c != given)]


def gmm_candidates(dims: tuple[int, int, int], given: Blocks) -> list[Blocks]:
    """The trial's tiles first, then every (rows, contraction, columns) of `GMM_ROWS` x
    `GMM_COLUMNS`^2 clamped to the pass's dims (each distinct once)."""
    out = [given]
    for tm in GMM_ROWS:
        for tk in GMM_COLUMNS:
            for tn in GMM_COLUMNS:
                tiles = tuple(min(t, d) for t, d in zip((tm, tk, tn), dims, strict=True))
                if tiles not in out:
                    out.append(tiles)
    return out


def megablox_candidates(rows: int, widest: int, given: Blocks) -> list[Blocks]:
    """The trial's tiling first, then `MEGABLOX_ROWS` that divide the routed rows by
    `GMM_COLUMNS`^2 no wider than the widest weight dim (each distinct once)."""
    columns = [c for c in GMM_COLUMNS if c <= widest] or [min(GMM_COLUMNS)]
    out = [given]
    for tm in (t for t in MEGABLOX_ROWS if rows % t == 0):
        for tk in columns:
            for tn in columns:
                if (tm, tk, tn) not in out:
                    out.append((tm, tk, tn))
    return out


def families(
    config: TrialConfig,
    global_batch: int,
    degrees: dict[str, int],
    device: jax.Device,
    interpret: bool = False,
) -> tuple[list[Family], list[str]]:
    """The families of this trial's program that can be tuned, and why any other cannot
    (`interpret`: Splash's kernel interpreted, off TPU)."""
    kernels = config.resolved_kernels(Backend.TPU, degrees["context"])
    out: list[Family] = []
    why: list[str] = []
    if kernels.attention == "splash":
        out.append(_splash(config, global_batch, degrees, device, interpret))
    if config.model.is_moe:
        if kernels.moe_gmm == "megablox":
            out.append(_megablox(config, global_batch, degrees, device))
        elif kernels.moe_gmm == "tokamax":
            for weight in ("wi", "wo"):
                family = _gmm(config, global_batch, degrees, device, weight)
                if isinstance(family, Family):
                    out.append(family)
                else:
                    why.append(family)
        else:
            why.append(f"the experts' grouped matmul is {kernels.moe_gmm}: it takes no tiles")
    if not out and not why:
        why.append("no Splash or tokamax grouped-matmul kernel in the program")
    return out, why


def _splash(config, global_batch, degrees, device, interpret: bool) -> Family:
    m = config.model
    batch = global_batch // (degrees["data"] * degrees["fsdp"] * degrees["expert"])
    tensor, context = degrees["tensor"], degrees["context"]
    shapes = {"batch": max(batch, 1), "seq": config.seq_len, "heads": m.num_heads // tensor,
              "kv_heads": max(m.num_kv_heads // tensor, 1), "head_dim": m.head_dim}  # fmt: skip
    if context > 1:  # one device's query chunk against every key (program/kernels.py)
        shapes.update(context=context, load_balanced=config.mesh.context_load_balance)
    given = {k: tuple(getattr(config.kernels, b) for b in f) for k, f in SPLASH.items()}
    queries = config.seq_len // context
    listed = {k: splash_candidates(config.seq_len, given[k], queries) for k in SPLASH}
    k = config.kernels
    layouts = [k.q_layout, k.k_layout, k.v_layout, k.dq_reduction_steps]

    def layer(trial: TrialConfig, part: str) -> Layer:
        return splash_layer(trial.kernels, shapes, part, interpret)

    parts = {"splash forward": "forward", "splash backward": "backward"}
    identity = {"shapes": shapes, "layouts": layouts}
    return Family("splash", SPLASH, given, listed, identity, SPLASH_NAMES, layer, "backward",
                  parts, device)  # fmt: skip


def _expert_shapes(config, global_batch, degrees) -> tuple[int, int, int, int]:
    """One device's expert matmuls: routed rows, d_model, mlp (over tensor), groups."""
    from trainer.estimate.analytic import routed_rows

    m = config.model
    tokens = global_batch * config.seq_len
    local = tokens / (degrees["data"] * degrees["fsdp"] * degrees["expert"] * degrees["context"])
    rows = max(round(routed_rows(config, degrees, local)), 1)
    return rows, m.d_model, m.mlp_dim // degrees["tensor"], m.num_experts // degrees["expert"]


def _megablox(config, global_batch, degrees, device) -> Family:
    rows, d, mlp, groups = _expert_shapes(config, global_batch, degrees)
    shapes = {"rows": rows, "in": d, "out": mlp, "groups": groups}
    k = config.kernels
    given = {"megablox": (k.gmm_tm, k.gmm_tk, k.gmm_tn)}
    listed = {"megablox": megablox_candidates(rows, max(d, mlp), given["megablox"])}

    def layer(trial: TrialConfig, part: str) -> Layer:
        return megablox_layer(trial.kernels, shapes)

    return Family("megablox", MEGABLOX, given, listed, {"shapes": shapes}, {"megablox": "gmm"},
                  layer, "all", {"megablox": "all"}, device)  # fmt: skip


def _gmm(config, global_batch, degrees, device, weight: str) -> Family | str:
    rows, d, mlp, groups = _expert_shapes(config, global_batch, degrees)
    k_in, n_out = (d, mlp) if weight == "wi" else (mlp, d)
    dims = {"fwd": (rows, k_in, n_out), "dlhs": (rows, n_out, k_in), "drhs": (rows, k_in, n_out)}
    fp8 = config.precision if config.fp8_experts_in_tokamax(Backend.TPU) else None
    shapes = {"rows": rows, "in": k_in, "out": n_out, "groups": groups}
    tiles = gmm_tiles(config.kernels, fp8 is not None, shapes, weight)
    if any(t is None for t in tiles.values()):
        return f"{weight}: tokamax takes its tiles from its own tuned table here (not tuned)"
    given = {f"{weight} {p}": t for p, t in tiles.items() if t}
    listed = {f"{weight} {p}": gmm_candidates(dims[p], given[f"{weight} {p}"]) for p in GMM_PASSES}
    knobs = {f"{weight} {p}": (f"tokamax_tiles.{weight}_{p}",) for p in GMM_PASSES}
    names = {f"{weight} {p}": GMM_NAMES[p] for p in ("drhs", "dlhs", "fwd")}

    def layer(trial: TrialConfig, part: str) -> Layer:
        return gmm_layer(trial.kernels, fp8, shapes, weight, part)

    parts = {f"{weight} {p}": p for p in GMM_PASSES}
    identity = {"shapes": shapes, "fp8": fp8.model_dump() if fp8 else None}
    return Family(f"gmm {weight}", knobs, given, listed, identity, names, layer, "all", parts,
                  device)  # fmt: skip
