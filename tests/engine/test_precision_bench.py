"""`prunewatch bench precision` on the probe model: structure and provenance of its result, never timings."""

from __future__ import annotations

import json

from prunewatch.bench import precision


def test_precision_bench_reports_every_configuration_with_its_interval(probe_model_dir, calibration_dir, tmp_path):
    out, plot = tmp_path / "precision.json", tmp_path / "precision.png"
    code = precision.main(["--model-dir", str(probe_model_dir), "--tokens", "4", "--rounds", "2", "--probes", "3",
                           "--max-new-tokens", "4", "--calibration-dir", str(calibration_dir),
                           "--out", str(out), "--plot", str(plot), "--no-compiled"])
    assert code == 0
    result = json.loads(out.read_text())
    assert result["command"].startswith("prunewatch bench precision")
    assert set(result["method"]) >= {"tokens_per_s", "agreement", "bytes_per_token", "speedup_vs_fp32_dense"}
    assert {r["mode"] for r in result["rows"]} == {"eager"}
    rows = {(r["precision"], r["plan"]): r for r in result["rows"]}
    assert set(rows) == {("fp32", "dense"), ("fp32", "default"), ("int8", "dense"), ("int8", "default")}
    assert rows[("fp32", "dense")]["speedup_vs_fp32_dense"] == 1.0
    assert rows[("int8", "dense")]["speedup_vs_same_precision_dense"] == 1.0
    # counted, not timed: int8 reads about a quarter of the weight bytes fp32 does per step
    assert rows[("int8", "dense")]["bytes_per_token"] < 0.45 * rows[("fp32", "dense")]["bytes_per_token"]
    assert rows[("fp32", "dense")]["decode_pruning_ratio"] == 0.0 == rows[("int8", "dense")]["decode_pruning_ratio"]
    # fp32 dense is its own reference: every answer token is its argmax
    assert rows[("fp32", "dense")]["agreement"] == 1.0 and rows[("fp32", "dense")]["changed_answers"] == 0.0
    for row in result["rows"]:
        assert len(row["rounds"]) == 2 and row["prompts"] == 3
        assert row["agreement_low"] <= row["agreement"] <= row["agreement_high"]
    assert plot.stat().st_size > 0
    assert "int8 default" in precision.format_table(result)
