"""How every prunewatch command reports bad input: one line on stderr, exit code 2, no traceback."""

from __future__ import annotations

import typer
from pydantic import ValidationError


def fail(message: str) -> typer.Exit:
    """Print `error: message` and return the Exit to raise (exit code 2: bad input)."""
    typer.echo(f"error: {message}", err=True)
    return typer.Exit(2)


def first_validation_error(exc: ValidationError) -> str:
    """The first pydantic validation error as `field: message (got value)`."""
    first = exc.errors()[0]
    where = ".".join(str(p) for p in first.get("loc", ())) or "value"
    return f"{where}: {first.get('msg')} (got {first.get('input')!r})"
