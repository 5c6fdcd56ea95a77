"""The trainer's output protocol: one JSON object per line on stdout, and exit codes."""

from __future__ import annotations

import json
import re
import sys
import time
from typing import Any, TextIO

PROTOCOL_VERSION = 1
# Failure class -> process exit code. 0 is success; the engine reads either.
EXIT_CODES = {
    "invalid_config": 2,
    "oom_hbm": 3,
    "oom_vmem": 4,
    "compile_error": 5,
    "diverged": 6,
    "timeout": 7,
    "crashed": 1,
}
FAILURE_CLASSES = tuple(EXIT_CODES)


class TrialFailure(Exception):
    """A classified ending of a trial; `failure_class` is one of FAILURE_CLASSES."""

    def __init__(self, failure_class: str, message: str, **details: Any):
        assert failure_class in EXIT_CODES, failure_class
        super().__init__(message)
        self.failure_class = failure_class
        self.message = message
        self.details = details


class Emitter:
    """Writes events to stdout (or `stream`); quiet=True lets library calls reuse the run loop.

    `only` limits what is written (all events are still kept): the other processes of a
    multi-host trial write only their failures, process 0 speaks for the trial.
    """

    def __init__(
        self,
        stream: TextIO | None = None,
        quiet: bool = False,
        only: frozenset[str] | None = None,
    ):
        self._stream = stream
        self.quiet = quiet
        self.only = only
        self.events: list[dict[str, Any]] = []

    def emit(self, event: str, **fields: Any) -> dict[str, Any]:
        record = {"event": event, "time": time.time(), **fields}
        self.events.append(record)
        if not self.quiet and (self.only is None or event in self.only):
            stream = self._stream or sys.stdout  # looked up late: stdout may be redirected
            stream.write(json.dumps(record, default=_jsonable) + "\n")
            stream.flush()
        return record


def _jsonable(value: Any) -> Any:
    if hasattr(value, "item"):
        return value.item()
    if hasattr(value, "tolist"):
        return value.tolist()
    return str(value)


def parse_line(line: str) -> dict[str, Any] | None:
    """An event from one line of trainer output, or None for anything that is not one."""
    line = line.strip()
    if not line.startswith("{"):
        return None
    try:
        record = json.loads(line)
    except json.JSONDecodeError:
        return None
    return record if isinstance(record, dict) and "event" in record else None


_VMEM = re.compile(r"vmem|CompileTimeScopedVmemOom", re.IGNORECASE)
_OOM = re.compile(r"RESOURCE_EXHAUSTED|Ran out of memory|out of memory", re.IGNORECASE)


def classify_exception(exc: BaseException, phase: str) -> str:
    """Failure class of an unexpected exception raised while `phase` ("compile"/"run") ran."""
    text = f"{type(exc).__name__}: {exc}"
    if _OOM.search(text):
        return "oom_vmem" if _VMEM.search(text) else "oom_hbm"
    if phase == "compile":
        return "compile_error"
    return "crashed"
