"""Files several processes read while one writes them, where a sweep's cache lives, and the
trainer's command line."""

from __future__ import annotations

import errno
import json
import os
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from trainer.trial.config import TrialConfig


# A folder that takes no more writes: full, over quota, or mounted read-only.
UNWRITABLE = (errno.ENOSPC, errno.EDQUOT, errno.EROFS)


def write_json(path: Path, obj: Any, *, indent: int | None = None, durable: bool = False) -> Path:
    """`obj` as JSON at `path`, atomically: a reader sees the old file or the whole new one
    (written beside it under this process' name, then renamed over it). `durable` also
    syncs it to disk first, for state that must survive the host going down."""
    return write_text(path, json.dumps(obj, indent=indent), durable=durable)


def write_text(path: Path, text: str, *, durable: bool = False) -> Path:
    """`text` at `path`, atomically (see `write_json`). A write that fails (a full disk)
    leaves the previous file whole and no temporary beside it, and raises."""
    return _write(path, text, durable)


def write_bytes(path: Path, data: bytes, *, durable: bool = False) -> Path:
    """`data` at `path`, atomically, as `write_text` writes text."""
    return _write(path, data, durable)


def _write(path: Path, data: str | bytes, durable: bool) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb" if isinstance(data, bytes) else "w") as f:
            f.write(data)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


DEFAULT_CACHE = Path(os.environ.get("SWEEPER_CACHE_DIR", Path.home() / ".cache" / "sweeper"))


def cache_dir(config: TrialConfig) -> Path:
    """The sweep's shared cache; a host that cannot write there keeps its own (the reference
    is then computed by the trial itself)."""
    path = Path(config.convergence.cache_dir) if config.convergence.cache_dir else DEFAULT_CACHE
    try:
        path.mkdir(parents=True, exist_ok=True)
        if os.access(path, os.W_OK):
            return path
    except OSError:
        pass
    return Path(tempfile.gettempdir()) / "sweeper-cache"


def die_with_parent() -> None:
    """In a child (preexec_fn): the kernel kills it when its parent dies (PR_SET_PDEATHSIG).
    Linux only: where there is no libc.so.6 the child is killed by its parent's handle alone."""
    import contextlib
    import ctypes
    import signal

    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL)


def trainer_command(
    config_path: str | Path, extra: Sequence[str] = (), python: str = sys.executable
) -> list[str]:
    """The trainer's command line as a trial starts it: this host's Python (on a remote node,
    the node's own interpreter, not the driver's), `-m trainer --config FILE`, then `extra`."""
    return [python, "-m", "trainer", "--config", str(config_path), *extra]
