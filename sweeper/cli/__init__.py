"""`sweeper`: the command line. Each command parses, calls the library and prints; errors a
user can fix exit 2 with the file, line and field."""

from sweeper.cli import importing, planning, records, sweeps, tiles
from sweeper.cli.app import app

__all__ = ["app", "importing", "planning", "records", "sweeps", "tiles"]
