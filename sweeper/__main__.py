"""`python -m sweeper`: the command line."""

from sweeper.cli import app

app()
