"""Splash blocks tuned per kernel at compile fidelity (`kernels.tune: compile`).

Each Splash kernel of a trial (its forward, and its fused dK/dV backward) is compiled alone,
at the trial's per-device shapes and under the trial's libtpu flags (its scoped VMEM limit
among them), for one device of the target, once for each candidate block size: the trial's
own blocks, and square blocks of 512 to 4096 rows that divide the sequence. A candidate the
compiler refuses (a scoped-VMEM overflow, a Mosaic error) is dropped with the compiler's
words; each that compiles is priced by the step model as the trial's program would run it
(its FLOPs over the MXU share its blocks fill, at least one grid step's time a step:
`kernel_seconds`), and the trial runs with the lowest of each kernel.

The forward and the backward of one candidate compile in one program and are priced apart;
a compile the backward refuses is tried again with the forward alone. Results are kept by
the kernel's shapes, layouts, flags, target and compiler (`TILES_DIR` of the sweep's cache):
a second trial with the same kernels reads them instead of compiling.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import jax

from trainer.compile.cost import program_cost
from trainer.compile.records import libtpu_version
from trainer.compile.step_model import kernel_flops, kernel_seconds
from trainer.program.hlo import parse
from trainer.program.kernels import splash_layer_hlo
from trainer.trial.config import TrialConfig
from trainer.trial.hardware import Backend, Topology

# The blocks of each kernel, and how its call is named in a compiled program.
KERNELS = {
    "forward": ("block_q", "block_kv", "block_kv_compute"),
    "backward": ("block_q_dkv", "block_kv_dkv", "block_kv_dkv_compute"),
}
CALLS = {"forward": "_fwd", "backward": "_dkv"}
SIZES = (512, 1024, 2048, 4096)
TILES_DIR = "tiles"
Blocks = tuple[int, int, int]


@dataclass
class Tried:
    """One candidate of one kernel: its blocks, its priced time, or why it did not compile."""

    blocks: Blocks
    seconds: float | None = None
    failure: str = ""


@dataclass
class Tuned:
    """One kernel's tuning: what the trial gave, what was tried, what was chosen."""

    kernel: str
    given: Blocks
    chosen: Blocks
    tried: list[Tried] = field(default_factory=list)

    def saving(self) -> float | None:
        """The chosen blocks' time over the given ones' (None when the given did not compile)."""
        times = {t.blocks: t.seconds for t in self.tried}
        given, chosen = times.get(self.given), times.get(self.chosen)
        return chosen / given if given and chosen else None


@dataclass
class Tuning:
    """Every kernel's tuning for one trial, and whether it was read from the cache."""

    kernels: list[Tuned]
    cached: bool = False
    seconds: float = 0.0

    def blocks(self) -> dict[str, int]:
        """The chosen blocks as the trial's kernels settings."""
        out: dict[str, int] = {}
        for tuned in self.kernels:
            out.update(zip(KERNELS[tuned.kernel], tuned.chosen, strict=True))
        return out

    def to_json(self) -> dict[str, Any]:
        return {"kernels": [asdict(k) for k in self.kernels], "seconds": self.seconds}

    @classmethod
    def from_json(cls, data: dict[str, Any], cached: bool) -> Tuning:
        kernels = [
            Tuned(
                kernel=k["kernel"],
                given=tuple(k["given"]),
                chosen=tuple(k["chosen"]),
                tried=[Tried(tuple(t["blocks"]), t["seconds"], t["failure"]) for t in k["tried"]],
            )
            for k in data["kernels"]
        ]
        return cls(kernels, cached, data.get("seconds", 0.0))

    def summary(self) -> str:
        """One line per kernel, for the trial's record."""
        lines = []
        for k in self.kernels:
            failed = [t for t in k.tried if t.failure]
            ratio = k.saving()
            said = f", {ratio:.3f}x the given blocks' time" if ratio else ""
            lines.append(
                f"{k.kernel} {'x'.join(map(str, k.chosen))} (given {'x'.join(map(str, k.given))}"
                f"{said}; {len(k.tried)} tried, {len(failed)} refused by the compiler)"
            )
        return "; ".join(lines) + (" [cached]" if self.cached else "")


def candidates(seq: int, given: Blocks) -> list[Blocks]:
    """The trial's blocks first, then square blocks that divide the sequence."""
    sizes = [s for s in SIZES if s <= seq and seq % s == 0]
    square = [(q, kv, kv) for q in sizes for kv in sizes]
    return [given, *(c for c in square if c != given)]


def tunable(config: TrialConfig, context: int) -> str | None:
    """Why the tuner cannot run for this trial; None when it can."""
    if config.compile_target is None:
        return "the tuner compiles for a TPU target: compile fidelity only"
    if config.resolved_kernels(Backend.TPU, context).attention != "splash":
        return "no Splash kernel in the program"
    if context != 1:
        return "context parallelism shards the kernel's mask: not tuned yet"
    return None


def tune_splash(
    config: TrialConfig,
    global_batch: int,
    degrees: dict[str, int],
    topology: Topology,
    device: jax.Device,
    cache: Path,
) -> Tuning:
    """Each Splash kernel's blocks for this trial (see the module's docstring)."""
    shapes = _shapes(config, global_batch, degrees)
    flags = sorted(os.environ.get("LIBTPU_INIT_ARGS", "").split())
    kernels = config.kernels
    given = {k: tuple(getattr(kernels, b) for b in KERNELS[k]) for k in KERNELS}
    listed = (
        candidates(config.seq_len, given["forward"]),
        candidates(config.seq_len, given["backward"]),
    )
    key = _key(shapes, kernels, flags, topology, listed)
    path = cache / TILES_DIR / f"{key}.json"
    if path.is_file():
        return Tuning.from_json(json.loads(path.read_text()), cached=True)
    started = time.perf_counter()
    tried: dict[str, dict[Blocks, Tried]] = {"forward": {}, "backward": {}}
    for fwd, bwd in zip(*_paired(*listed), strict=True):
        _try(config, global_batch, degrees, topology, device, shapes, fwd, bwd, tried,
             given["forward"])  # fmt: skip
    tuning = Tuning([_chosen(k, given[k], tried[k]) for k in KERNELS])
    tuning.seconds = time.perf_counter() - started
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(tuning.to_json(), indent=1))
    return tuning


def _paired(forward: list[Blocks], backward: list[Blocks]) -> tuple[list[Blocks], list[Blocks]]:
    """Candidates compiled together, the forward's i-th with the backward's i-th (the shorter
    list repeats its first: the trial's own)."""
    n = max(len(forward), len(backward))
    pad = lambda xs: xs + [xs[0]] * (n - len(xs))  # noqa: E731
    return pad(forward), pad(backward)


def _shapes(config: TrialConfig, global_batch: int, degrees: dict[str, int]) -> dict[str, int]:
    """One device's Splash operands: batch, sequence, query and key/value heads, head width."""
    m = config.model
    batch = global_batch // (degrees["data"] * degrees["fsdp"] * degrees["expert"])
    tensor = degrees["tensor"]
    return {"batch": max(batch, 1), "seq": config.seq_len, "heads": m.num_heads // tensor,
            "kv_heads": max(m.num_kv_heads // tensor, 1), "head_dim": m.head_dim}  # fmt: skip


def _key(shapes, kernels, flags, topology: Topology, listed) -> str:
    layouts = [kernels.q_layout, kernels.k_layout, kernels.v_layout, kernels.dq_reduction_steps]
    inputs = [shapes, layouts, flags, topology.accelerator.name, jax.__version__,
              libtpu_version(), [list(map(list, x)) for x in listed],
              _source_digest()]  # fmt: skip
    return hashlib.sha256(json.dumps(inputs, default=str).encode()).hexdigest()[:24]


def _source_digest() -> str:
    """This module's and the step model's code: a change to how candidates are priced makes
    every earlier result a miss."""
    here = Path(__file__).parent
    body = b"".join((here / f"{n}.py").read_bytes() for n in ("tiles", "step_model"))
    return hashlib.sha256(body).hexdigest()[:16]


def _try(config, global_batch, degrees, topology, device, shapes, fwd, bwd, tried, own) -> None:
    """Compile one forward and one backward candidate together and price each. A compile the
    compiler refuses names the kernel it refused: that candidate fails, and the other kernel's
    is compiled again without it (the forward alone, or the backward beside the trial's own
    forward blocks, `own`)."""
    want = {"forward": fwd not in tried["forward"], "backward": bwd not in tried["backward"]}
    if not any(want.values()):
        return
    blocks = dict(zip(KERNELS["forward"] + KERNELS["backward"], fwd + bwd, strict=True))
    trial = config.model_copy(update={"kernels": config.kernels.model_copy(update=blocks)})
    candidate = {"forward": fwd, "backward": bwd}
    try:
        calls = _compiled_calls(trial, shapes, device, backward=True)
    except Exception as exc:  # the compiler's refusal, and the kernel it names
        failure, named = _failure(exc)
        refused = [named] if named else list(KERNELS)
        for kernel in refused:
            if want[kernel]:
                tried[kernel][candidate[kernel]] = Tried(candidate[kernel], failure=failure)
        if named == "backward" and want["forward"]:
            try:
                calls = _compiled_calls(trial, shapes, device, backward=False)
            except Exception as again:
                tried["forward"][fwd] = Tried(fwd, failure=_failure(again)[0])
                return
            _price(trial, global_batch, degrees, topology, calls, "forward", fwd, tried)
        elif named == "forward" and want["backward"] and fwd != own:
            _try(config, global_batch, degrees, topology, device, shapes, own, bwd, tried, own)
        return
    for kernel in KERNELS:
        if want[kernel]:
            _price(trial, global_batch, degrees, topology, calls, kernel, candidate[kernel], tried)


def _price(trial, global_batch, degrees, topology, calls, kernel, block, tried) -> None:
    accel = topology.accelerator
    flops = kernel_flops(trial, global_batch, topology.devices, 1, calls, degrees["expert"],
                         accel.mxu_width)  # fmt: skip
    seconds = [
        kernel_seconds(f, n, accel)
        for c, f, n in zip(calls, flops.each, flops.steps, strict=True)
        if c["name"].startswith("splash_") and CALLS[kernel] in c["name"]
    ]
    if seconds:
        tried[kernel][block] = Tried(block, seconds=sum(seconds))


def _failure(exc: Exception) -> tuple[str, str | None]:
    """The compiler's words (its VMEM figures where it gives them) and the kernel it names."""
    text = " ".join(str(exc).split())
    named = (
        "backward"
        if "splash_mqa_dkv" in text
        else ("forward" if "splash_mqa_fwd" in text else None)
    )
    limit = re.search(
        r"Scoped allocation with size \S+ and limit \S+ exceeded scoped vmem limit by \S+"
        r"|Used \S+ of \S+ vmem",
        text,
    )
    at = text.find("Ran out of memory")
    said = limit.group(0) if limit else (text[at : at + 160] if at >= 0 else text[:200])
    return f"{type(exc).__name__}: {said}", named


def _compiled_calls(trial: TrialConfig, shapes: dict[str, int], device, backward: bool) -> list:
    """The Mosaic calls of one Splash layer at these shapes, compiled for `device`."""
    hlo = splash_layer_hlo(trial.kernels, shapes, device, backward)
    return program_cost(parse(hlo))["kernel_calls"]


def _chosen(kernel: str, given: Blocks, tried: dict[Blocks, Tried]) -> Tuned:
    priced = [t for t in tried.values() if t.seconds is not None]
    best = min(priced, key=lambda t: (t.seconds, t.blocks != given)) if priced else None
    return Tuned(kernel, given, best.blocks if best else given, list(tried.values()))
