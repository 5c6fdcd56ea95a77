"""Terminal output that outlives its reader: `sweeper run ... | head` closes the pipe after a
few lines, and a sweep must go on (or a `validate` end well), its later lines dropped, not die
of a broken pipe in the middle of its records."""

from __future__ import annotations

import io
import os
import sys
from typing import TextIO, cast

from rich.console import Console


class PipeSafe(io.TextIOBase):
    """A text stream that drops what it is given once its reader has gone (a closed pipe),
    and points its descriptor at /dev/null so that nothing fails when the process exits."""

    def __init__(self, stderr: bool = False):
        self.stderr = stderr
        self.gone = False

    @property
    def stream(self) -> TextIO:
        """The process's stream as it is now (a test may have replaced it); under a rich
        progress or status (a Live), which proxies it through the console that writes here,
        the file beneath: else each write would print itself again, without end."""
        stream = sys.stderr if self.stderr else sys.stdout
        return cast(TextIO, getattr(stream, "rich_proxied_file", stream))

    def write(self, text: str) -> int:
        if not self.gone:
            try:
                self.stream.write(text)
                self.stream.flush()
            except BrokenPipeError:
                self._reader_gone()
        return len(text)

    def flush(self) -> None:
        if not self.gone:
            try:
                self.stream.flush()
            except BrokenPipeError:
                self._reader_gone()

    def _reader_gone(self) -> None:
        self.gone = True
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, self.stream.fileno())
            os.close(devnull)
        except (OSError, ValueError):  # no descriptor (a test's stream): nothing to point
            pass

    def isatty(self) -> bool:
        return not self.gone and self.stream.isatty()

    def fileno(self) -> int:
        return self.stream.fileno()

    @property
    def encoding(self) -> str:  # type: ignore[override]  # rich reads it
        return getattr(self.stream, "encoding", None) or "utf-8"


def terminal(stderr: bool = False, width: int | None = None) -> Console:
    """A rich Console on stdout (or stderr) that a closed pipe does not break. Without a width
    it reads COLUMNS (else the terminal's) each time it prints, not once when it is made: the
    CLI's consoles are made when the module is imported, before a command (or a test) sets it."""
    console = Console(file=cast(TextIO, PipeSafe(stderr)), width=width)
    console._width = width  # rich fixed COLUMNS at import; `Console.size` reads it live
    return console
