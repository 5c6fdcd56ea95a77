"""Files several processes read while one writes them."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def write_json(path: Path, obj: Any, *, indent: int | None = None, durable: bool = False) -> Path:
    """`obj` as JSON at `path`, atomically: a reader sees the old file or the whole new one
    (written beside it under this process' name, then renamed over it). `durable` also
    syncs it to disk first, for state that must survive the host going down."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=indent)
        if durable:
            f.flush()
            os.fsync(f.fileno())
    os.replace(tmp, path)
    return path
