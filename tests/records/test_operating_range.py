"""A model's operating range: the thresholds it gives, each with its evidence, and its cache files."""

from __future__ import annotations

import dataclasses
import json

import pytest

from prunewatch.records.metrics import CollectorMetrics
from prunewatch.records.operating_range import (
    THRESHOLD_KINDS,
    Derivation,
    OperatingRange,
    PhaseTimes,
    load_ranges,
    range_path,
    thresholds_of,
)


def _range(**changes) -> OperatingRange:
    base = OperatingRange(
        model="m", model_fingerprint="a" * 64, source="calibration", measured_at="2026-03-01T08:00:00+00:00",
        probe_set="evaluation prompts (evaluation.yaml, domains legal)", probe_set_digest="0" * 64, prompts=5,
        sensitivity=0.5, engine={"activation_sparsity": 0.6}, device="cpu: test", ratio=0.12, ratio_max=0.14,
        agreement={"estimate": 0.9, "low": 0.85, "high": 0.95, "prompts": 5, "tokens": 300},
        agreement_per_prompt=[0.7, 0.85, 0.9, 0.95, 1.0], dense=PhaseTimes(0.05, 0.002),
        default=PhaseTimes(0.04, 0.0024))
    return dataclasses.replace(base, **changes)


def test_thresholds_follow_from_the_measured_figures_and_say_how() -> None:
    t = {x.kind: x for x in _range().thresholds()}
    assert list(t) == list(THRESHOLD_KINDS)
    assert t["ratio_low"].value == pytest.approx(0.06)  # half the ratio measured at the default
    assert (t["ratio_red_line"].value, t["ratio_risk"].value) == (pytest.approx(0.21), pytest.approx(0.28))
    assert t["quality_floor"].value == pytest.approx(0.73)  # 5th percentile of 0.7 .. 1.0, interpolated
    assert t["tpot_vs_dense_max"].value == pytest.approx(1.5)  # faster than dense: max(1, 0.8) x 1.5
    assert t["ttft_vs_dense_max"].value == pytest.approx(1.8)  # 1.2 slower at the default, x 1.5
    assert all(x.source == "calibration" and x.model == "m" for x in t.values())
    assert "0.5 x the mean pruning ratio 0.1200 at sensitivity 0.5, measured at calibration on 5 evaluation" \
        in t["ratio_low"].evidence
    assert "quality past it was not measured" in t["ratio_red_line"].evidence
    assert "0.900 [0.850, 0.950] (5 prompts, 300 tokens)" in t["quality_floor"].evidence


def test_a_sweep_measures_the_quality_lines_and_missing_figures_give_no_threshold() -> None:
    swept = _range(source="tune", swept_red_line=0.2, swept_risk_ratio=0.25,
                   sweep_evidence={"ratio_risk": "lowest mean ratio measured with quality below 0.95: 0.25"})
    t = {x.kind: x for x in swept.thresholds()}
    assert (t["ratio_red_line"].value, t["ratio_risk"].value) == (0.2, 0.25)
    assert t["ratio_risk"].evidence.startswith("lowest mean ratio measured with quality below 0.95: 0.25, measured by "
                                               "`prunewatch tune`")
    bare = _range(ratio=0.0, ratio_max=0.0, agreement=None, agreement_per_prompt=[], dense=PhaseTimes())
    assert bare.thresholds() == []  # nothing pruned, nothing scored, no dense time: the rules' fallbacks
    with pytest.raises(ValueError, match="red_line_factor"):
        Derivation(red_line_factor=3.0, risk_factor=2.0)


def test_ranges_are_cached_per_model_and_the_newest_one_is_read(tmp_path) -> None:
    old, new = _range(), _range(model_fingerprint="b" * 64, measured_at="2026-03-05T08:00:00+00:00", ratio=0.2)
    for r in (old, new, _range(model="other")):
        r.save(range_path(tmp_path, r.model, r.model_fingerprint))
    (tmp_path / "broken.operating-range.json").write_text("{not json")
    found = load_ranges(tmp_path)
    assert sorted(found) == ["m", "other"] and found["m"].ratio == 0.2
    assert list(load_ranges(tmp_path, ["other"])) == ["other"] and load_ranges(tmp_path / "none") == {}
    saved = json.loads(range_path(tmp_path, "m", "b" * 64).read_text())
    assert saved["thresholds"][0]["kind"] == "ratio_low" and saved["version"] == 1
    assert OperatingRange.load(range_path(tmp_path, "m", "b" * 64)) == new


def test_the_collector_exports_them_with_their_source() -> None:
    metrics = CollectorMetrics()
    metrics.set_thresholds(thresholds_of([_range()]))
    assert metrics.registry.get_sample_value(
        "prunewatch_alert_threshold", {"model": "m", "kind": "ratio_low", "source": "calibration"}) == \
        pytest.approx(0.06)
