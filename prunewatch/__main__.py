"""`python -m prunewatch` runs the command line."""

from prunewatch.cli import main

main()
