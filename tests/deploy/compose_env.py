"""What `docker compose` does to docker-compose.yml before it runs anything: read .env, fill ${...}.

Docker cannot run on the development machines, so the tests reproduce compose's interpolation
(the compose specification's rules) to see the file as compose would: `$$` is a literal `$`,
`${VAR}` / `$VAR`, `${VAR:-default}` (unset or empty), `${VAR-default}` (unset),
`${VAR:?message}` (error when unset or empty), `${VAR?message}` (error when unset).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

_TOKEN = re.compile(
    r"\$(?:(?P<escaped>\$)"
    r"|\{(?P<braced>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:-|-|:\?|\?)(?P<arg>[^}]*))?\}"
    r"|(?P<named>[A-Za-z_][A-Za-z0-9_]*))"
)


class MissingVariables(ValueError):
    """Required variables (${VAR:?...}) are unset or empty; `names` lists them."""

    def __init__(self, names: set[str]) -> None:
        super().__init__(f"required variables not set: {', '.join(sorted(names))}")
        self.names = names


def read_env_file(path: Path) -> dict[str, str]:
    """KEY=VALUE lines of a compose .env file (comments and blank lines skipped, no quoting used here)."""
    values: dict[str, str] = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.partition("=")
        if not sep:
            raise ValueError(f"{path}: not KEY=VALUE: {line!r}")
        values[key.strip()] = value.strip()
    return values


def variables_used(document: Any) -> set[str]:
    """Names of every variable the strings of a parsed compose file refer to (comments are not read)."""
    if isinstance(document, str):
        return {m.group("braced") or m.group("named") for m in _TOKEN.finditer(document) if not m.group("escaped")}
    if isinstance(document, list):
        return set().union(*(variables_used(item) for item in document))
    if isinstance(document, dict):
        return set().union(*(variables_used(value) for value in document.values()))
    return set()


def interpolate(document: Any, env: dict[str, str]) -> Any:
    """The document with every string interpolated; MissingVariables names all unmet requirements."""
    missing: set[str] = set()

    def one(text: str) -> str:
        def replace(match: re.Match) -> str:
            if match.group("escaped"):
                return "$"
            name = match.group("braced") or match.group("named")
            op, arg = match.group("op"), match.group("arg")
            value = env.get(name)
            if op == ":-":
                return value or arg
            if op == "-":
                return arg if value is None else value
            if op in (":?", "?") and (value is None or (op == ":?" and value == "")):
                missing.add(name)
                return ""
            return value or ""

        return _TOKEN.sub(replace, text)

    def walk(node: Any) -> Any:
        if isinstance(node, str):
            return one(node)
        if isinstance(node, list):
            return [walk(item) for item in node]
        if isinstance(node, dict):
            return {key: walk(value) for key, value in node.items()}
        return node

    result = walk(document)
    if missing:
        raise MissingVariables(missing)
    return result
