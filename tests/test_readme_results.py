"""The README's result tables are the committed benchmark JSON, rendered by the bench's own formatter.

A figure typed by hand drifts from the run it cites; here each cited table is re-rendered from its JSON and
every line must appear in the README verbatim, so a new run without a README update (or the reverse) fails.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from prunewatch.bench import batch_sparsity, frontier, load, mechanisms, precision, prefix_cache, speed

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"

CITED_TABLES: tuple[tuple[str, Callable[[dict], str]], ...] = (
    ("bench/results/mechanisms-smollm2-cpu.json", mechanisms.format_table),
    ("bench/results/mechanisms-cpu.json", mechanisms.format_table),
    ("bench/results/frontier-SmolLM2-135M-Instruct.json", frontier.format_table),
    ("bench/results/precision-cpu.json", precision.format_table),
    ("bench/results/load-cpu.json", load.format_table),
    ("bench/results/batch-sparsity-cpu.json", batch_sparsity.format_table),
    ("bench/results/prefix-cache-cpu.json", prefix_cache.format_table),
    ("bench/results/speed-served-cpu.json", speed.format_projection_markdown),
)


@pytest.mark.parametrize(("path", "render"), CITED_TABLES, ids=[path for path, _ in CITED_TABLES])
def test_readme_table_is_the_committed_result(path: str, render: Callable[[dict], str]) -> None:
    readme = README.read_text(encoding="utf-8")
    assert path in readme, f"the README no longer cites {path}"
    table = render(json.loads((ROOT / path).read_text(encoding="utf-8")))
    missing = [line for line in table.splitlines() if line.strip() and line not in readme]
    assert not missing, f"README lines that differ from {path} (re-render with the bench's format_table):\n" + \
        "\n".join(missing)
