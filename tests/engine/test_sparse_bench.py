"""The engine benchmark's quick mode end to end: it writes one JSON row per configuration whose derived
figures follow from its measured ones, and a plot."""

from __future__ import annotations

import json

import pytest

from prunewatch.bench.engine import QUICK, format_table, run


def test_quick_benchmark_writes_consistent_rows_and_a_plot(tmp_path, probe_model_dir):
    out = tmp_path / "engine-cpu.json"
    config = QUICK.model_copy(update={"probe_model_dir": probe_model_dir})
    run(config, out, out.with_suffix(".png"))
    result = json.loads(out.read_text())
    assert result["device"] == "cpu" and result["quick"] is True
    rows = result["speed"]["rows"]
    assert [(r["batch"], r["policy"]) for r in rows] == [(1, "row"), (4, "row"), (4, "shared")]
    for r in rows:
        assert r["bound"] == pytest.approx(1 / (1 - r["sparsity"] * r["f"]), abs=1e-3)
        assert r["speedup"] == pytest.approx(r["sparse_tokens_per_s"] / r["dense_tokens_per_s"], rel=1e-3)
        assert r["fraction_of_bound"] == pytest.approx(r["speedup"] / r["bound"], rel=1e-3)
        assert 0.5 < r["f"] < 1.0 and r["dense_tokens_per_s"] > 0 and r["sparse_tokens_per_s"] > 0
    single, union, shared = rows
    assert abs(single["sparsity"] - 0.5) < 0.05  # one row: the work skipped is what the thresholds zero
    assert union["sparsity"] < union["input_sparsity"] - 0.2  # four rows read the union of their channels
    assert shared["sparsity"] == pytest.approx(0.5, abs=0.01)  # the shared policy keeps the top half
    quality = result["quality"]["rows"]
    assert {(q["policy"], q["target_sparsity"]) for q in quality} == {("row", 0.5), ("shared", 0.5)}
    row_quality = next(q for q in quality if q["policy"] == "row")
    assert 0.0 <= row_quality["agreement"] <= 1.0 and row_quality["perplexity_sparse"] > 0
    assert out.with_suffix(".png").stat().st_size > 10_000
    assert format_table(result).count("\n| 4 |") == 2
