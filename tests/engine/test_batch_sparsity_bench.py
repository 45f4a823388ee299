"""`prunewatch bench batch-sparsity` on the probe model: its JSON's shape and the numbers that must hold (no
timings asserted)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from prunewatch.bench import batch_sparsity


def test_batch_sparsity_bench_reports_each_way_at_each_batch(probe_model_dir: Path, calibration_dir: Path,
                                                              tmp_path: Path) -> None:
    out = tmp_path / "batch.json"
    assert batch_sparsity.main(["--model-dir", str(probe_model_dir), "--batches", "1,3", "--tokens", "4",
                                "--quality-batch", "3", "--probes", "4", "--max-new-tokens", "4",
                                "--calibration-dir", str(calibration_dir), "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["command"].startswith("prunewatch bench batch-sparsity")
    rows = {(r["batch"], r["way"]): r for r in result["rows"]}
    assert set(rows) == {(b, w) for b in (1, 3) for w in ("dense", "union", "policy")}
    for (batch, way), row in rows.items():
        assert row["aggregate_tokens_per_s"] > 0
        assert 0.0 <= row["decode_pruning_ratio"] < 1.0
        assert 1.0 <= row["mean_batch_size"] <= batch
        if way == "dense":
            assert row["decode_pruning_ratio"] == 0.0 and row["vs_dense"] == 1.0
    # alone, the union and the policy are the same plan: the request's own pruning
    assert rows[(1, "union")]["decode_pruning_ratio"] == rows[(1, "policy")]["decode_pruning_ratio"] > 0.0
    assert rows[(1, "dense")]["mean_batch_size"] == 1.0
    assert max(rows[(3, w)]["mean_batch_size"] for w in ("dense", "union", "policy")) > 1.0
    alone, together = result["quality"]
    assert (alone["batch"], together["batch"]) == (1, 3)
    for row in (alone, together):
        assert row["prompts"] == 4 and row["answer_tokens"] > 0
        assert 0.0 <= row["agreement_low"] <= row["agreement"] <= row["agreement_high"] <= 1.0
    assert alone["changed_vs_alone"] == 0.0 and alone["mean_batch_size"] == 1.0
    assert together["mean_batch_size"] > 1.0
    table = batch_sparsity.format_table(result)
    assert table.count("\n") == 1 + len(result["rows"]) + 3 + len(result["quality"])


@pytest.mark.parametrize("argv", [["--batches", "0"], ["--batches", "two"], ["--tokens", "1"],
                                  ["--quality-batch", "1"], ["--probes", "0"], ["--model-dir", "/nonexistent"]])
def test_batch_sparsity_bench_refuses_bad_arguments(argv: list[str], probe_model_dir: Path) -> None:
    with pytest.raises(SystemExit) as exit_info:
        batch_sparsity.main(["--model-dir", str(probe_model_dir), *argv] if argv[0] != "--model-dir" else argv)
    assert exit_info.value.code == 2
