"""Compiled TPU programs by identity: one compile per distinct program, and which flags act.

A compile trial's program is fixed by its lowering and its LIBTPU flags. Trials that agree
on both share one compile (a cache in the sweep's storage); a flag knob whose program is
byte-identical to the one compiled with the knob at its default is inert.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import subprocess
import tempfile
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import Any

import jax

from trainer.program import hlo
from trainer.trial.config import TrialConfig, XlaFlagsConfig
from trainer.trial.files import trainer_command, write_json
from trainer.trial.flags import BASE_LIBTPU_ARGS

# The trial's flag knobs and their values at the default.
FLAG_KNOBS = {
    f: getattr(XlaFlagsConfig(), f) for f in ("scoped_vmem_kib", "collective_mode", "extra")
}


def libtpu_version() -> str:
    try:
        return metadata.version("libtpu")
    except metadata.PackageNotFoundError:
        return "none"


# What a record holds is what these modules read from a program: a change to any of them
# makes every earlier record a miss.
_READERS = ("aot", "cost", "ops", "schedule", "mosaic")


@functools.cache
def _readers_digest() -> str:
    here = Path(__file__).parent
    sources = [(here / f"{name}.py").read_bytes() for name in _READERS]
    sources.append(Path(hlo.__file__).read_bytes())
    return hashlib.sha256(b"".join(sources)).hexdigest()[:16]


def program_key(lowered_text: str, flags: list[str], target: str) -> str:
    """A compile record's identity: the lowered program, its flags, target and compiler,
    and the code that read the record from the compiled program."""
    inputs = [_readers_digest(), lowered_text, sorted(flags), target, jax.__version__,
              libtpu_version()]  # fmt: skip
    return hashlib.sha256(json.dumps(inputs).encode()).hexdigest()[:24]


class ProgramCache:
    """Compile records (fingerprint, memory, collectives, compile time) by program key,
    in `<cache_dir>/programs/`; a host that cannot write there compiles every time."""

    def __init__(self, root: Path):
        self.root = root / "programs"

    def get(self, key: str) -> dict[str, Any] | None:
        path = self.root / f"{key}.json"
        return json.loads(path.read_text()) if path.exists() else None

    def put(self, key: str, record: dict[str, Any]) -> None:
        with contextlib.suppress(OSError):  # a cache that cannot be written is no cache
            write_json(self.root / f"{key}.json", record)


def cached_compile(
    key: str, cache: ProgramCache, compile_fn: Callable[[], dict[str, Any]]
) -> tuple[dict[str, Any], bool]:
    """The record of program `key`, and whether another trial had compiled it already."""
    record = cache.get(key)
    if record is not None:
        return record, True
    record = compile_fn()
    cache.put(key, record)
    return record, False


def twin_fingerprint(config: TrialConfig, field: str, default: Any) -> tuple[str, str]:
    """("fingerprint", hash) of this trial's program with `xla.<field>` at its default,
    compiled by a child trainer (libtpu reads its flags once per process), or ("failure",
    class) when that program does not compile."""
    twin = config.model_copy(
        update={"xla": config.xla.model_copy(update={field: default, "judge": False})}
    )
    env = {**os.environ, "LIBTPU_INIT_ARGS": os.environ.get(BASE_LIBTPU_ARGS, "")}
    env.pop(BASE_LIBTPU_ARGS, None)
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        f.write(twin.to_json())
    try:
        proc = subprocess.run(
            trainer_command(f.name),
            capture_output=True,
            text=True,
            env=env,
        )
    finally:
        os.unlink(f.name)
    events = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    for event in events:
        if event.get("event") == "compiled" and event.get("program_fingerprint"):
            return "fingerprint", event["program_fingerprint"]
    failure: dict[str, Any] = next((e for e in events if e.get("event") == "failure"), {})
    return "failure", failure.get("failure_class", f"exit {proc.returncode}")


def flag_effects(
    config: TrialConfig,
    fingerprint: str,
    twin: Callable[[TrialConfig, str, Any], tuple[str, str]] = twin_fingerprint,
) -> dict[str, dict[str, str]]:
    """Per flag knob this trial sets: `inert` when its program with the knob at its default
    is the same program, else `active`."""
    effects = {}
    for field, default in FLAG_KNOBS.items():
        value = getattr(config.xla, field)
        if value == default:
            continue
        kind, other = twin(config, field, default)
        if kind == "failure":
            status, reason = "active", f"with {default!r} the program does not compile ({other})"
        elif other == fingerprint:
            status = "inert"
            reason = (
                f"{value!r} compiles to the same program as {default!r} (fingerprint "
                f"{fingerprint}) for {config.compile_target}"
            )
        else:
            status, reason = "active", f"changes the compiled program ({other} -> {fingerprint})"
        effects[f"xla.{field}"] = {"status": status, "reason": reason}
    return effects
