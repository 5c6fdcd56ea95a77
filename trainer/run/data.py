"""Training batches: byte-level text of the running Python's standard library, or synthetic tokens."""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from trainer.parallel.context import load_balance_order
from trainer.trial.config import TrialConfig
from trainer.trial.files import cache_dir


@functools.cache
def stdlib_corpus(max_bytes: int, cache: Path | None = None) -> np.ndarray:
    """The stdlib's .py sources in sorted path order, concatenated, as uint8 tokens; kept in
    `cache` once read, for the sweep's later trials (walking the stdlib's thousands of files
    takes 3 s on a CPU host, every trial)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    if cache is None:
        return _read_corpus(root, max_bytes)
    kept = cache / f"stdlib-corpus-{sys.version_info[0]}.{sys.version_info[1]}-{max_bytes}.npy"
    if kept.exists():
        try:
            return np.load(kept)
        except (OSError, ValueError):
            pass  # a damaged copy: read the sources again
    corpus = _read_corpus(root, max_bytes)
    with contextlib.suppress(OSError):
        part = kept.with_suffix(f".{os.getpid()}.part")
        with part.open("wb") as f:
            np.save(f, corpus)
        part.replace(kept)
    return corpus


def _read_corpus(root: Path, max_bytes: int) -> np.ndarray:
    files = sorted(
        p for p in root.rglob("*.py") if not {"site-packages", "dist-packages"} & set(p.parts)
    )
    chunks, total = [], 0
    for path in files:
        data = path.read_bytes()
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    if total == 0:
        raise FileNotFoundError(f"no Python sources under {root} to build the corpus from")
    return np.frombuffer(b"".join(chunks)[:max_bytes], dtype=np.uint8)


@dataclass(frozen=True)
class Batch:
    inputs_BxS: np.ndarray
    targets_BxS: np.ndarray
    positions_BxS: np.ndarray


class BatchSource:
    """Deterministic batches: batch `step` depends only on (seed, step), so runs are reproducible."""

    def __init__(self, config: TrialConfig, global_batch: int, context: int):
        self.config = config
        self.global_batch = global_batch
        self.vocab_size = config.model.vocab_size
        self.order = None
        if context > 1 and config.mesh.context_load_balance:
            self.order = load_balance_order(config.seq_len, context)
        self.corpus = None
        if config.data.source == "stdlib":
            if self.vocab_size < 256:
                raise ValueError("model.vocab_size must be >= 256 for byte-level stdlib data")
            self.corpus = stdlib_corpus(int(config.data.max_corpus_mib * 2**20), cache_dir(config))

    def batch(self, step: int) -> Batch:
        rng = np.random.default_rng([self.config.seed, step])
        length = self.config.seq_len + 1
        if self.corpus is not None:
            starts = rng.integers(0, len(self.corpus) - length, size=self.global_batch)
            windows = self.corpus[starts[:, None] + np.arange(length)].astype(np.int32)
        else:
            windows = rng.integers(
                0, self.vocab_size, size=(self.global_batch, length), dtype=np.int32
            )
        positions = np.broadcast_to(
            np.arange(self.config.seq_len, dtype=np.int32), (self.global_batch, self.config.seq_len)
        )
        inputs, targets = windows[:, :-1], windows[:, 1:]
        if self.order is not None:
            inputs, targets, positions = (
                inputs[:, self.order],
                targets[:, self.order],
                positions[:, self.order],
            )
        return Batch(
            np.ascontiguousarray(inputs),
            np.ascontiguousarray(targets),
            np.ascontiguousarray(positions),
        )
