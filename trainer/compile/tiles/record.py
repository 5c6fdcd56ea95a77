"""What a tuning found: each kernel's candidates (priced, or refused with the compiler's
words), the tiles it chose, and how the trial's settings take them."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from trainer.trial.config import KernelsConfig

Blocks = tuple[int, ...]


def settings_of(knobs: tuple[str, ...], blocks: Blocks) -> dict[str, int | str]:
    """A kernel's tiles as the trial's kernels settings: Splash's block fields, or one
    `tokamax_tiles.<weight>_<pass>` as "TMxTKxTN"."""
    if knobs[0].startswith("tokamax_tiles."):
        return {knobs[0]: "x".join(map(str, blocks))}
    return dict(zip(knobs, blocks, strict=True))


@dataclass
class Tried:
    """One candidate of one kernel: its tiles, its priced time per call, or why it did not
    compile."""

    blocks: Blocks
    seconds: float | None = None
    failure: str = ""


@dataclass
class Tuned:
    """One kernel's tuning: the settings its tiles are (`knobs`: Splash's three block fields,
    or one `tokamax_tiles.<weight>_<pass>`), what the trial gave, what was tried and chosen."""

    kernel: str
    knobs: tuple[str, ...]
    given: Blocks
    chosen: Blocks
    tried: list[Tried] = field(default_factory=list)

    def saving(self) -> float | None:
        """The chosen tiles' time over the given ones' (None when the given did not compile)."""
        times = {t.blocks: t.seconds for t in self.tried}
        given, chosen = times.get(self.given), times.get(self.chosen)
        return chosen / given if given and chosen else None

    def settings(self) -> dict[str, int | str]:
        """The chosen tiles as the trial's kernels settings."""
        return settings_of(self.knobs, self.chosen)


@dataclass
class Tuning:
    """Every kernel's tuning for one trial, whether it was read from the cache, and the
    scoped VMEM limit it was tuned under (None: the trial's flags as they stand)."""

    kernels: list[Tuned]
    cached: bool = False
    seconds: float = 0.0
    vmem_kib: int | None = None

    def settings(self) -> dict[str, int | str]:
        """The chosen tiles of every kernel, as `Tuned.settings`."""
        out: dict[str, int | str] = {}
        for tuned in self.kernels:
            out.update(tuned.settings())
        return out

    def apply(self, kernels: KernelsConfig) -> KernelsConfig:
        """`kernels` running the chosen tiles."""
        return kernels.tuned(self.settings())

    def to_json(self) -> dict[str, Any]:
        return {
            "kernels": [asdict(k) for k in self.kernels],
            "seconds": self.seconds,
            "vmem_kib": self.vmem_kib,
            "cached": self.cached,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any], cached: bool) -> Tuning:
        kernels = [
            Tuned(
                kernel=k["kernel"],
                knobs=tuple(k["knobs"]),
                given=tuple(k["given"]),
                chosen=tuple(k["chosen"]),
                tried=[Tried(tuple(t["blocks"]), t["seconds"], t["failure"]) for t in k["tried"]],
            )
            for k in data["kernels"]
        ]
        return cls(kernels, cached, data.get("seconds", 0.0), data.get("vmem_kib"))

    def summary(self) -> str:
        """One clause per kernel, for the trial's record."""
        lines = []
        for k in self.kernels:
            failed = [t for t in k.tried if t.failure]
            ratio = k.saving()
            said = f", {ratio:.3f}x the given tiles' time" if ratio else ""
            lines.append(
                f"{k.kernel} {'x'.join(map(str, k.chosen))} (given {'x'.join(map(str, k.given))}"
                f"{said}; {len(k.tried)} tried, {len(failed)} refused by the compiler)"
            )
        return "; ".join(lines) + (" [cached]" if self.cached else "")
