"""`python -m prunewatch` runs the command line."""

from prunewatch.cli import app

app()
