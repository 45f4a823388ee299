"""The mechanisms benchmark end to end on two probes: one row per configuration, figures that follow
from the engine's own measurements (dense is exact, each mechanism skips only its own kind of work),
and a plot."""

from __future__ import annotations

import json

import pytest

from prunewatch.bench.mechanisms import DENSE, QUALITY_TARGET, Mechanisms, format_table, run


def test_mechanisms_bench_measures_each_mechanism_against_dense(tmp_path, probe_model_dir, calibration_dir):
    grid = (DENSE, Mechanisms(name="bypass", influence_budget=0.5), Mechanisms(name="heads", head_budget=0.25),
            Mechanisms(name="sparsity", activation_sparsity=0.8))
    out = tmp_path / "mechanisms.json"
    result = run(grid, out, out.with_suffix(".png"), model_dir=probe_model_dir, calibration_dir=calibration_dir,
                 max_new_tokens=6, probes=2)
    assert json.loads(out.read_text()) == result
    rows = {r["name"]: r for r in result["rows"]}
    dense = rows["dense"]
    assert (dense["pruning_ratio"], dense["agreement"], dense["speedup"], dense["changed_answers"]) == (0.0, 1.0, 1.0, 0)
    assert dense["agreement_low"] <= 1.0 == dense["agreement_high"] and dense["prompts"] == 2
    assert (dense["decode_pruning_ratio"], dense["heldout_perplexity_delta_pct"]) == (0.0, 0.0)
    bypass, heads, sparsity = rows["bypass"], rows["heads"], rows["sparsity"]
    assert bypass["layers_bypassed"] > 0 and bypass["heads_gated"] == 0 and bypass["activation_sparsity"] == 0
    assert heads["heads_gated"] > 0 and heads["layers_bypassed"] == 0 and heads["activation_sparsity"] == 0
    assert sparsity["activation_sparsity"] > 0 and sparsity["layers_bypassed"] == sparsity["heads_gated"] == 0
    for row in (bypass, heads, sparsity):
        assert 0.0 < row["pruning_ratio_min"] <= row["pruning_ratio"] <= row["pruning_ratio_max"] < 1.0
        assert row["agreement_min"] <= row["agreement_low"] <= row["agreement"] <= row["agreement_high"] <= 1.0
        assert row["requests"] == row["prompts"] == 2 and row["tokens"] > 0 and row["served_nll"] > 0
        assert row["meets_quality"] == (row["heldout_perplexity_delta_pct"] <= QUALITY_TARGET["perplexity_delta_pct"]
                                        and row["agreement"] >= QUALITY_TARGET["agreement"]
                                        and row["agreement_low"] >= QUALITY_TARGET["agreement_low"])
        phases = (row["prefill_pruning_ratio"], row["decode_pruning_ratio"])  # per request, the whole ratio lies
        assert min(phases) - 1e-3 <= row["pruning_ratio"] <= max(phases) + 1e-3  # between them (FLOP-weighted)
    assert sparsity["prefill_pruning_ratio"] == 0.0 < sparsity["decode_pruning_ratio"]  # long prefills run dense
    assert out.with_suffix(".png").stat().st_size > 10_000
    assert format_table(result).count("\n|") == len(grid) + 1
    with pytest.raises(ValueError, match="must be 'dense'"):
        run(grid[1:], out, None, model_dir=probe_model_dir, calibration_dir=calibration_dir)
