"""The error a user can fix in a space: it names the file, line (when known) and field."""

from __future__ import annotations


class SpaceError(ValueError):
    """A space a user can fix: names the file, line (when known) and field."""

    def __init__(
        self,
        message: str,
        *,
        file: str | None = None,
        line: int | None = None,
        field: str | None = None,
    ):
        where = file or "<space>"
        if line is not None:
            where += f":{line}"
        if file is None and field and field.startswith("--"):
            where = ""  # a command-line option's fault, not a space's: the option names it
        super().__init__(f"{where + ': ' if where else ''}{field + ': ' if field else ''}{message}")
        self.file, self.line, self.field, self.message = file, line, field, message
