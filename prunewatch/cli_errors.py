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


def needs_extra(exc: ModuleNotFoundError, extra: str) -> str:
    """The one line for a command whose part is not installed: which package is missing and which extra brings it."""
    package = (exc.name or "a package").split(".")[0]
    return f"this command needs {package}, which is not installed: pip install 'prunewatch[{extra}]'"
