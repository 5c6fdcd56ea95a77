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

import hashlib
import json
import os
import time
from pathlib import Path
from typing import Any

import jax

from trainer.compile.tiles.families import Blocks, Family, families
from trainer.compile.tiles.record import Tried, Tuned, Tuning
from trainer.compile.tiles.search import TILES_DIR, failure_words, source_digest
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
    key = _key(found, device)
    path = cache / TILES_DIR / f"{key}.json"
    if path.is_file():
        return Tuning.from_json(json.loads(path.read_text()), cached=True), untuned
    started = time.perf_counter()
    kernels = []
    for family in found:
        for kernel in family.knobs:
            tried = time_kernel(family, kernel, config, device)
            timed = [t for t in tried if t.seconds is not None]
            given = family.given[kernel]
            best = min(timed, key=lambda t: (t.seconds, t.blocks != given)) if timed else None
            chosen = best.blocks if best else given
            kernels.append(Tuned(kernel, family.knobs[kernel], given, chosen, tried))
    tuning = Tuning(kernels, seconds=time.perf_counter() - started)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(tuning.to_json(), indent=1))
    return tuning, untuned


def _key(found: list[Family], device: Any) -> str:
    flags = sorted(os.environ.get("LIBTPU_INIT_ARGS", "").split())
    inputs: list[Any] = [[f.name, f.identity, f.given, f.listed] for f in found]
    inputs += [METHOD, flags, device.platform, device.device_kind, jax.__version__,
               source_digest()]  # fmt: skip
    return hashlib.sha256(json.dumps(inputs, default=str).encode()).hexdigest()[:24]
