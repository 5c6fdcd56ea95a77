"""Each family's candidates compiled and priced (see the package's docstring), and the
results kept by what identifies them."""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import jax

from trainer.compile.records import libtpu_version
from trainer.compile.step_model import calls_seconds, kernel_flops
from trainer.compile.tiles.families import Blocks, Family, families
from trainer.compile.tiles.record import Tried, Tuned, Tuning
from trainer.trial.config import TrialConfig
from trainer.trial.hardware import Backend, Topology

TILES_DIR = "tiles"
# Told as each candidate's compile begins: compiles begun, about how many in all, the family.
Progress = Callable[[int, int, str], None]
VMEM_OPTION = "xla_tpu_scoped_vmem_limit_kib"


class Search:
    """One trial's tuning: its shapes and batch, the device and target it compiles for, the
    scoped VMEM limit (None: the trial's flags as they stand), and the kinds of family its
    program takes no tiles for, each with why (`untaken`: a family's name's first word)."""

    def __init__(self, config, global_batch, degrees, topology: Topology, device, vmem_kib=None,
                 untaken: Mapping[str, str] | None = None,
                 progress: Progress | None = None):  # fmt: skip
        self.config, self.global_batch, self.degrees = config, global_batch, degrees
        self.topology, self.device = topology, device
        self.vmem_kib = vmem_kib
        self.options = {VMEM_OPTION: vmem_kib} if vmem_kib else None
        found, self.untuned = families(config, global_batch, degrees, device)
        untaken = untaken or {}
        self.families = [f for f in found if f.kind not in untaken]
        self.untuned += [f"{f.name}: {untaken[f.kind]}" for f in found if f.kind in untaken]
        self.progress, self.done = progress, 0
        self.total = sum(max(len(x) for x in f.listed.values()) for f in self.families)

    def run(self, cache: Path) -> Tuning:
        key = kernels_key(self.families, self.vmem_kib, self.topology.accelerator.name,
                          libtpu_version())  # fmt: skip
        return kept(cache, key, lambda: [t for f in self.families for t in self.tune(f)],
                    self.vmem_kib)  # fmt: skip

    def tune(self, family: Family) -> list[Tuned]:
        """Every candidate of the family's kernels tried, the i-th of each compiled together
        (a shorter list repeats its first, the trial's own), and each kernel's cheapest."""
        tried: dict[str, dict[Blocks, Tried]] = {k: {} for k in family.knobs}
        n = max(len(x) for x in family.listed.values())
        for i in range(n):
            pick = {k: xs[i] if i < len(xs) else xs[0] for k, xs in family.listed.items()}
            self._try(family, pick, tried)
        return [chosen(family, k, list(tried[k].values())) for k in family.knobs]

    def _try(self, family: Family, pick: dict[str, Blocks], tried, retry: bool = True) -> None:
        """Compile one program of `pick` and price each kernel's call. A compile the compiler
        refuses names the kernel it refused (else every wanted one fails): that candidate
        fails, and the others are compiled again beside a tile of it that compiled (the
        trial's own where none has yet)."""
        want = {k: b not in tried[k] for k, b in pick.items()}
        if not any(want.values()):
            return
        trial = family.trial(self.config, pick)
        self.done += 1
        if self.progress is not None:  # a refusal's second compile: one more than counted
            self.progress(self.done, max(self.total, self.done), family.name)
        try:
            calls = family.calls(trial, self.options)
        except Exception as exc:  # the compiler's refusal, and the kernel it names
            failure, named = failure_words(exc), family.owner(" ".join(str(exc).split()))
            for kernel in [named] if named else list(pick):
                if want[kernel]:
                    tried[kernel][pick[kernel]] = Tried(pick[kernel], failure=failure)
            if named and retry and any(w for k, w in want.items() if k != named):
                fits = [t.blocks for t in tried[named].values() if t.seconds is not None]
                other = fits[0] if fits else family.given[named]
                if other != pick[named]:
                    self._try(family, {**pick, named: other}, tried, retry=False)
            return
        for kernel, blocks in pick.items():
            if want[kernel]:
                seconds = self._price(trial, family, calls, kernel)
                tried[kernel][blocks] = (
                    Tried(blocks, seconds=seconds)
                    if seconds is not None
                    else Tried(blocks, failure="compiled without this kernel (XLA's path ran)")
                )

    def _price(self, trial, family: Family, calls: list, kernel: str) -> float | None:
        """The step model's time for one execution of each of `kernel`'s calls, summed."""
        accel = self.topology.accelerator
        flops = kernel_flops(trial, self.global_batch, self.topology.devices,
                             self.degrees["context"], calls, self.degrees["expert"],
                             accel.mxu_width)  # fmt: skip
        seconds = [
            s
            for c, s in zip(calls, calls_seconds(calls, flops, accel), strict=True)
            if family.owner(c["name"]) == kernel
        ]
        return sum(seconds) if seconds else None


def chosen(family: Family, kernel: str, tried: list[Tried]) -> Tuned:
    """`kernel`'s tuning: the candidate of least time (priced or timed), the trial's own where
    none has one. On a tie the trial's own, else the largest tiles (first dim first): fewer
    grid steps, and each streams its operands fewer times, which the price does not count
    where the kernel's work hides it (Splash's query blocks at 128k)."""
    given = family.given[kernel]
    timed = [t for t in tried if t.seconds is not None]

    def order(t: Tried) -> tuple:
        return (t.seconds, t.blocks != given, tuple(-b for b in t.blocks))

    best = min(timed, key=order) if timed else None
    return Tuned(kernel, family.knobs[kernel], given, best.blocks if best else given, tried)


def kernels_key(found: list[Family], *more: Any) -> str:
    """The identity of these families' kernels (shapes, layouts, dtypes, given tiles and
    candidates) under the host's flags, JAX, this package's and the step model's code, and
    `more` (the VMEM limit, target and compiler; or the method and device)."""
    flags = sorted(os.environ.get("LIBTPU_INIT_ARGS", "").split())
    inputs: list[Any] = [[f.name, f.identity, f.given, f.listed] for f in found]
    inputs += [flags, jax.__version__, source_digest(), *more]
    return hashlib.sha256(json.dumps(inputs, default=str).encode()).hexdigest()[:24]


def kept(
    cache: Path, key: str, tune: Callable[[], list[Tuned]], vmem_kib: int | None = None
) -> Tuning:
    """The tuning kept under `key` in `cache`; else `tune()`'s, timed and kept there."""
    path = cache / TILES_DIR / f"{key}.json"
    if path.is_file():
        return Tuning.from_json(json.loads(path.read_text()), cached=True)
    started = time.perf_counter()
    kernels = tune()
    tuning = Tuning(kernels, seconds=time.perf_counter() - started, vmem_kib=vmem_kib)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(tuning.to_json(), indent=1))
    return tuning


def source_digest() -> str:
    """This package's and the step model's code: a change to how candidates are made or
    priced makes every earlier result a miss."""
    here = Path(__file__).parent
    files = [*sorted(here.glob("*.py")), here.parent / "step_model.py"]
    return hashlib.sha256(b"".join(f.read_bytes() for f in files)).hexdigest()[:16]


def failure_words(exc: Exception) -> str:
    """The compiler's words (its VMEM figures where it gives them)."""
    text = " ".join(str(exc).split())
    limit = re.search(
        r"Scoped allocation with size \S+ and limit \S+ exceeded scoped vmem limit by \S+"
        r"|Used \S+ of \S+ vmem",
        text,
    )
    at = text.find("Ran out of memory")
    said = limit.group(0) if limit else (text[at : at + 160] if at >= 0 else text[:200])
    return f"{type(exc).__name__}: {said}"


def tune(
    config: TrialConfig,
    global_batch: int,
    degrees: dict[str, int],
    topology: Topology,
    device: jax.Device,
    cache: Path,
    vmem_kib: int | None = None,
    untaken: Mapping[str, str] | None = None,
    progress: Progress | None = None,
) -> tuple[Tuning, list[str]]:
    """This trial's kernels tuned (read from `cache` where tuned before), and why any
    kernel of its program was not (`untaken`: kinds of family the program takes no tiles
    for, and why; `progress`: told of each compile, as it begins)."""
    search = Search(config, global_batch, degrees, topology, device, vmem_kib, untaken, progress)
    if not search.families:
        return Tuning([], vmem_kib=vmem_kib), search.untuned
    return search.run(cache), search.untuned


def as_json(tuning: Tuning, untuned: list[str]) -> dict[str, Any]:
    """A tuning as the trial records it (its folder's tuning.json)."""
    return {**tuning.to_json(), "untuned": untuned, "settings": tuning.settings()}


def applied(
    config: TrialConfig, tuning: Tuning, untuned: list[str], how: str, best: str
) -> tuple[TrialConfig, dict[str, dict[str, str]], dict[str, Any] | None]:
    """The trial running what `tuning` chose, the `kernels.tune` effect (active where a tile
    changed, inert where the trial's own were `best` or nothing could be tuned; what was tried
    and `how`, how long it took), and the trial's record (None when nothing was tuned)."""
    if not tuning.kernels:
        return config, {"kernels.tune": {"status": "inert", "reason": "; ".join(untuned)}}, None
    kernels = tuning.apply(config.kernels)
    changed = kernels != config.kernels
    took = "read from the cache" if tuning.cached else f"{tuning.seconds:.0f} s"
    reason = f"{tuning.summary()}; {how} in {took}"
    if untuned:
        reason += f"; not tuned: {'; '.join(untuned)}"
    if not changed:
        reason = f"the trial's own tiles {best}: " + reason
    effect = {"kernels.tune": {"status": "active" if changed else "inert", "reason": reason}}
    return config.model_copy(update={"kernels": kernels}), effect, as_json(tuning, untuned)


def per_vmem(
    config: TrialConfig,
    limits: list[int],
    devices: list[jax.Device],
    untaken: Mapping[str, str] | None = None,
    progress: Callable[[int, int, int, str], None] | None = None,
) -> Iterator[dict[str, Any]]:
    """The trial's kernels tuned under each scoped VMEM limit in turn (`sweeper tiles`), for
    its target's `devices`: one record a limit, as `as_json` with the limit (`untaken`: as
    `tune`'s; `progress`: told of each compile, with the limit's place among them). Raises
    ConfigError for a trial that cannot be built on its target."""
    from trainer.trial.checks import check_static, global_batch_size
    from trainer.trial.files import cache_dir

    topology = Topology.parse(config.compile_target or "")
    degrees = check_static(config, len(devices), Backend.TPU)
    batch = global_batch_size(config, len(devices))
    for i, limit in enumerate(limits):
        told = None if progress is None else functools.partial(progress, i)
        tuning, untuned = tune(
            config, batch, degrees, topology, devices[0], cache_dir(config), limit, untaken, told
        )
        yield {"vmem_kib": limit, **as_json(tuning, untuned)}
