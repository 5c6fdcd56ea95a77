"""Kernel tiles timed on the trial's own device (`kernels.tune: time`): at run fidelity on a
TPU, each kernel's candidates (the same as the compile tuner's) are compiled for the device
(a refusal, a VMEM overflow or a Mosaic error, is dropped with the compiler's words) and the
rest timed by tune-jax in the part of the layer that kernel runs in (Splash's forward alone,
or its forward and backward; a grouped matmul's forward alone, or with one gradient), the
other kernels at the trial's own tiles; the fastest of each runs in the trial. Each kernel's
time is its program's: the others' share is the same in every candidate.

Off TPU nothing is timed: a CPU interprets Pallas TPU kernels and a GPU runs none of these,
so their time says nothing of a TPU's (the effect says inert). `interpret` times them anyway,
interpreted, for the engine's own tests of this path on CPU: never a finding."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax

from trainer.compile.tiles.families import Blocks, Family, families
from trainer.compile.tiles.record import Tried, Tuning
from trainer.compile.tiles.search import chosen, failure_words, kept, kernels_key
from trainer.program.kernels import compiled_hlo, example_args
from trainer.trial.config import TrialConfig

METHOD = "time"


def time_kernel(family: Family, kernel: str, config: TrialConfig, device: Any) -> list[Tried]:
    """Every candidate of `kernel` compiled for `device`, and those that compile timed by
    tune-jax (seconds of the kernel's part of the layer, per call)."""
    import tune_jax

    tried: dict[Blocks, Tried] = {}
    ready: list[tuple[Blocks, Any]] = []
    specs: list = []
    for blocks in family.listed[kernel]:
        trial = family.trial(config, {**family.given, kernel: blocks})
        fn, specs = family.layer(trial, family.parts[kernel])
        try:
            compiled_hlo((fn, specs), device)
        except Exception as exc:  # the compiler's refusal
            tried[blocks] = Tried(blocks, failure=failure_words(exc))
            continue
        ready.append((blocks, jax.jit(fn)))
    if ready:
        args = example_args(specs, device)

        def run(*args: Any, pick: int = 0) -> Any:
            return ready[pick][1](*args)

        timed = tune_jax.tune(run, hyperparams={"pick": list(range(len(ready)))})
        timed(*args)
        for result in timed.timing_results.values():
            blocks = ready[result.hyperparams["pick"]][0]
            tried[blocks] = Tried(blocks, seconds=float(result.t_mean))
        for blocks, _ in ready:
            tried.setdefault(blocks, Tried(blocks, failure="tune-jax dropped it (no timing)"))
    return [tried[b] for b in family.listed[kernel] if b in tried]


def timed_tiles(
    config: TrialConfig,
    global_batch: int,
    degrees: dict[str, int],
    device: Any,
    cache: Path,
    interpret: bool = False,
) -> tuple[Tuning, list[str]]:
    """Every tunable kernel of the trial timed on `device` (read from `cache` where timed
    before on this device kind), and why any other kernel was not."""
    found, untuned = families(config, global_batch, degrees, device, interpret)
    if not found:
        return Tuning([]), untuned
    key = kernels_key(found, METHOD, device.platform, device.device_kind)
    tuning = kept(cache, key, lambda: [
        chosen(f, kernel, time_kernel(f, kernel, config, device)) for f in found for kernel in f.knobs
    ])  # fmt: skip
    return tuning, untuned
