"""`python -m sweeper.cli`."""

from sweeper.cli.app import app

app()
