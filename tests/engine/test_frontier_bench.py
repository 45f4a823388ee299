"""The frontier benchmark end to end on the probe model with tiny settings: one row per point with the
curve it belongs to, dense exact, the default-vs-TEAL check computed from the rows, and a plot."""

from __future__ import annotations

import json

import pytest

from prunewatch.bench.frontier import (
    DENSE_POINT,
    FrontierPoint,
    _sweep,
    check,
    default_point,
    format_table,
    ratio_at,
    run,
)


def test_frontier_bench_structure(tmp_path, probe_model_dir, calibration_dir):
    points = (DENSE_POINT, default_point(), *_sweep("teal-uniform", (0.3,)),
              FrontierPoint(name="greedy 0.3 + heads 0.05", curve="combination", allocation="greedy",
                            activation_sparsity=0.3, head_budget=0.05))
    out = tmp_path / "frontier.json"
    result = run(points, out, out.with_suffix(".png"), model_dir=probe_model_dir, calibration_dir=calibration_dir,
                 max_new_tokens=4, probes=2)
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    rows = {r["name"]: r for r in result["rows"]}
    assert list(rows) == [p.name for p in points]
    dense = rows["dense"]
    assert (dense["decode_pruning_ratio"], dense["agreement"], dense["heldout_perplexity_delta_pct"]) == (0.0, 1.0, 0.0)
    combined = rows["greedy 0.3 + heads 0.05"]
    assert combined["allocation"] == "greedy" and rows["teal-uniform 0.3"]["allocation"] == "uniform"
    assert rows["engine default"]["allocation"] == "greedy" and rows["engine default"]["sensitivity"] == 0.5
    for name in ("teal-uniform 0.3", "greedy 0.3 + heads 0.05", "engine default"):
        assert 0.0 < rows[name]["decode_pruning_ratio"] < 1.0 and rows[name]["requests"] == 2
    assert combined["heads_gated"] > 0 and combined["activation_sparsity"] > 0
    plan = result["greedy_plan"]
    assert plan["method"] == "greedy" and len(plan["text_sha256"]) == 64 and plan["mean_sparsity_by_projection"]
    verdict = result["check"]
    assert set(verdict) >= {"dominates", "doubles_from_0_95", "by_agreement", "default_point", "met"}
    assert verdict["by_agreement"][0]["agreement"] == 0.9 and verdict["by_agreement"][-1]["agreement"] == 0.99
    assert out.with_suffix(".png").stat().st_size > 10_000
    assert format_table(result).count("\n|") == len(points) + 1
    with pytest.raises(ValueError, match="must be 'dense'"):
        run(points[1:], out, None, model_dir=probe_model_dir, calibration_dir=calibration_dir)


def test_check_reads_the_curves_as_envelopes():
    def row(name, curve, ratio, agreement, allocation="uniform", sparsity=0.3, half_width=0.01):
        return {"name": name, "curve": curve, "decode_pruning_ratio": ratio, "agreement": agreement,
                "agreement_low": agreement - half_width, "agreement_high": agreement + half_width,
                "allocation": allocation, "score": "magnitude", "influence_budget": 0.0, "head_budget": 0.0,
                "activation_sparsity_budget": sparsity}

    teal = [row("t1", "teal-uniform", 0.05, 0.97), row("t2", "teal-uniform", 0.10, 0.93)]
    assert ratio_at(teal, 0.95) == 0.05 and ratio_at(teal, 0.99) == 0.0 and ratio_at(teal, 0.90) == 0.10
    ours = [row("d", "engine default", 0.12, 0.96, "greedy"), row("g", "greedy", 0.25, 0.91, "greedy"),
            row("g1", "greedy", 0.11, 0.975, "greedy"), row("g0", "greedy", 0.02, 0.995, "greedy")]
    verdict = check(teal + ours)
    assert verdict["dominates"] and verdict["doubles_from_0_95"] and verdict["met"]
    assert verdict["default_point"]["times_teal"] == 2.4
    # t1 (0.05) pairs with g1 (0.11), t2 (0.10) with g1 too: intervals overlap for t1, separate for t2.
    assert [(p["teal"], p["ours"], p["claim"]) for p in verdict["pairs"]] == [
        ("t1", "g1", "no difference claimed"), ("t2", "g1", "ours better")]
    assert (verdict["ours_better"], verdict["ours_worse"]) == (1, 0)
    worse = check(teal + [row("d", "engine default", 0.06, 0.96, "greedy")])
    assert worse["dominates"] is False and worse["met"] is False  # at 0.90-0.93 TEAL reaches 0.10
    # Dominating estimates with a separated loss at a matched ratio is not met either.
    lossy = check(teal + [row("d", "engine default", 0.12, 0.96, "greedy"),
                          row("g", "greedy", 0.06, 0.93, "greedy", half_width=0.005)])
    assert lossy["pairs"][0]["claim"] == "ours worse" and lossy["met"] is False


def test_the_default_curve_is_the_defaults_mechanism_only():
    """Points with another output-head target than the default's are another mechanism: they do not
    lift the default's curve; a head-only point of the default's mechanism does."""
    def row(name, curve, ratio, agreement, sparsity, head):
        return {"name": name, "curve": curve, "decode_pruning_ratio": ratio, "agreement": agreement,
                "agreement_low": agreement - 0.01, "agreement_high": agreement + 0.01,
                "allocation": "greedy", "score": "magnitude", "influence_budget": 0.0, "head_budget": 0.0,
                "activation_sparsity_budget": sparsity, "output_head_sparsity_budget": head}

    teal = [{**row("t", "teal-uniform", 0.05, 0.97, 0.1, 0.0), "allocation": "uniform"}]
    default = row("d", "engine default", 0.20, 0.96, 0.6, 0.6)
    no_head = row("g", "greedy", 0.30, 0.99, 0.3, 0.0)  # would double TEAL at 0.99 if it counted
    assert check(teal + [default, no_head])["by_agreement"][-1]["default_ratio"] == 0.0
    head_only = row("h", "output head", 0.12, 1.0, 0.0, 0.6)
    verdict = check(teal + [default, no_head, head_only])
    assert verdict["by_agreement"][-1]["default_ratio"] == 0.12 and "h" in verdict["default_curve"]
    assert "g" not in verdict["default_curve"]
