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
        # A check of a space as loaded knows no file: the field alone names what to fix (the
        # CLI names the space's file, `in_file`), and a command-line option's fault names it.
        where = "" if file is None else file if line is None else f"{file}:{line}"
        super().__init__(f"{where + ': ' if where else ''}{field + ': ' if field else ''}{message}")
        self.file, self.line, self.field, self.message = file, line, field, message

    def in_file(self, file: str) -> SpaceError:
        """This error said of the space in `file`, where it names no file and is not a
        command-line option's fault."""
        if self.file is not None or (self.field or "").startswith("--"):
            return self
        return SpaceError(self.message, file=file, line=self.line, field=self.field)
