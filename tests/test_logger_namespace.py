"""Every logger the package creates is under "prunewatch", the logger `serve` and `run` configure: a record
logged anywhere else would be dropped under them (as engine loading and calibration logs once were)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "prunewatch"
FOREIGN = {"apscheduler", "httpx"}  # third-party loggers the package only quiets


def _logger_names(source: Path) -> list[tuple[int, str]]:
    """(line, name) of each logging.getLogger(...) call; `__name__` resolves to the module's dotted path."""
    module = ".".join(source.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__")
    found = []
    for node in ast.walk(ast.parse(source.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "getLogger":
            if not node.args:
                found.append((node.lineno, ""))  # the root logger
            elif isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
                found.append((node.lineno, node.args[0].value))
            elif isinstance(node.args[0], ast.Name) and node.args[0].id == "__name__":
                found.append((node.lineno, module))
    return found


def test_every_logger_is_under_the_prunewatch_logger() -> None:
    outside = [f"{path.relative_to(PACKAGE.parent)}:{line} {name or '<root>'}"
               for path in sorted(PACKAGE.rglob("*.py"))
               for line, name in _logger_names(path)
               if name not in FOREIGN and name != "prunewatch" and not name.startswith("prunewatch.")]
    assert outside == []


def test_module_loggers_resolve_to_their_dotted_path() -> None:
    """The check itself: `__name__` in prunewatch/engine/loading.py is prunewatch.engine.loading."""
    assert "prunewatch.engine.loading" in [name for _, name in _logger_names(PACKAGE / "engine" / "loading.py")]
