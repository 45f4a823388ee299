"""The command line and the read-only parts stay light: no torch for --help, the ROI app, alerts or dashboards.

torch takes seconds to import; a user asking for --help, or the ROI app reading the store, has no use
for it. Each check runs in a fresh interpreter, so nothing imported by other tests hides a regression.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

HEAVY = ("torch", "transformers")

EVERY_HELP = r"""
import sys
import typer
from typer.testing import CliRunner
from prunewatch.cli import app

root = typer.main.get_command(app)

def paths(command, prefix=()):
    yield prefix
    for name, sub in (getattr(command, "commands", None) or {}).items():  # groups list their commands
        yield from paths(sub, prefix + (name,))

runner = CliRunner()
seen = 0
# A benchmark's own page comes from its argparse parser, which lives with the benchmark and its torch code:
# those pages render last, after every other page was checked to leave torch unimported.
every = sorted(paths(root), key=lambda path: len(path) > 1 and path[0] == "bench")
heavy = None
for path in every:
    if heavy is None and len(path) > 1 and path[0] == "bench":
        heavy = sorted(m for m in ("torch", "transformers") if m in sys.modules)
    result = runner.invoke(app, [*path, "--help"])
    assert result.exit_code == 0, (path, result.output)
    seen += 1
print(seen, heavy)
"""


def _run(code: str) -> str:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip()


def test_every_help_page_renders_without_torch():
    count, heavy = _run(EVERY_HELP).split(" ", 1)
    assert int(count) >= 20  # every command and group, models and bench included
    assert heavy == "[]"


@pytest.mark.parametrize("module", ["prunewatch.roi.app", "prunewatch.roi.report", "prunewatch.alerts", "prunewatch.dashboards.build", "prunewatch.records.results",
                                    "prunewatch.records.store"])
def test_readers_of_the_store_import_no_torch(module):
    loaded = _run(f"import sys, {module}; print(sorted(m for m in {HEAVY!r} if m in sys.modules))")
    assert loaded == "[]", f"import {module} pulls in {loaded}"
