"""Pruned against dense time per token, paired by prompt within a baseline round, with an interval over pairs."""

from __future__ import annotations

import math

import pytest
from prometheus_client import CollectorRegistry

from prunewatch.records.intervals import bootstrap_ratio
from prunewatch.records.latency_window import LatencyWindow, LatencyWindows
from prunewatch.records.metrics import CollectorMetrics
from prunewatch.records.results import ProbeResult


def run(probe: str, round_id: str, *, tps: float, ttft_ms: float = 40.0, baseline: bool = False,
        sensitivity: float = 0.5, target: str = "t", status: str = "ok", **extra) -> ProbeResult:
    return ProbeResult(target=target, model="m", probe_id=probe, probe_version=1, probe_hash="h" * 16,
                       domain="legal", status=status, round_id=round_id, decode_tokens_per_s=tps, ttft_ms=ttft_ms,
                       prompt_tokens=20, baseline=baseline, sensitivity=0.0 if baseline else sensitivity, **extra)


def test_a_pair_is_one_prompt_pruned_and_dense_in_the_same_round_in_either_order():
    window = LatencyWindow()
    assert not window.add(run("a", "r1", tps=20.0))  # pruned, waiting for its dense run
    assert window.add(run("a", "r1", tps=25.0, baseline=True))
    assert not window.add(run("b", "r1", tps=20.0, baseline=True))  # dense first this time
    assert window.add(run("b", "r1", tps=10.0))
    decode = window.ratio("decode")
    # (1/20 + 1/10) / (1/25 + 1/20): pooled pruned over pooled dense seconds per token
    assert decode.prompts == 2 and math.isclose(decode.estimate, (0.05 + 0.1) / (0.04 + 0.05))
    assert math.isclose(window.ratio("first_token").estimate, 1.0)


def test_runs_without_a_partner_in_their_round_never_pair():
    window = LatencyWindow()
    assert not window.add(run("a", "r1", tps=20.0))  # an ordinary round: no baseline
    assert not window.add(run("a", "r2", tps=25.0, baseline=True))  # a dense run of another round
    assert not window.add(run("a", "r2", tps=20.0, fallback_reason="anomalous_input"))  # served dense: no evidence
    assert not window.add(run("a", "r2", tps=20.0, status="failed"))
    assert window.ratio("decode") is None


def test_old_baseline_rounds_leave_the_window_and_a_new_setting_starts_over():
    window = LatencyWindow(window_rounds=2)
    for i, tps in enumerate((10.0, 20.0, 20.0)):  # pruned at half the dense speed, then as fast
        window.add(run("a", f"r{i}", tps=tps))
        window.add(run("a", f"r{i}", tps=20.0, baseline=True))
    assert window.ratio("decode").estimate == 1.0 and window.ratio("decode").prompts == 2
    window.add(run("a", "r9", tps=10.0, sensitivity=0.7))
    window.add(run("a", "r9", tps=20.0, baseline=True))
    assert (window.sensitivity, window.ratio("decode").prompts, window.ratio("decode").estimate) == (0.7, 1, 2.0)
    with pytest.raises(ValueError, match="unknown phase"):
        window.ratio("prefill")


def test_few_noisy_pairs_give_a_wide_interval_many_steady_ones_a_narrow_one():
    one = bootstrap_ratio([2.0], [1.0])
    assert (one.estimate, one.low, one.high) == (2.0, 0.0, math.inf)  # one pair says nothing of the spread
    noisy = bootstrap_ratio([1.0, 2.6], [1.0, 1.0])
    assert noisy.low <= 1.0 < 1.8 == noisy.estimate <= noisy.high
    steady = bootstrap_ratio([1.8, 1.82, 1.79, 1.81, 1.8, 1.78], [1.0] * 6)
    assert 1.75 < steady.low < steady.estimate < steady.high < 1.85
    assert bootstrap_ratio([], []) is None
    with pytest.raises(ValueError):
        bootstrap_ratio([1.0], [0.0])
    with pytest.raises(ValueError):
        bootstrap_ratio([1.0, 2.0], [1.0])


def test_windows_are_per_target_and_exported_with_phase_and_bound():
    windows = LatencyWindows()
    windows.add(run("a", "r1", tps=10.0))
    assert windows.add(run("a", "r1", tps=10.0, baseline=True, target="u")) is None  # another target's dense run
    metrics = CollectorMetrics(CollectorRegistry())
    for probe, pruned in (("a", 10.0), ("b", 12.5)):
        metrics.record(run(probe, "r1", tps=pruned))
        metrics.record(run(probe, "r1", tps=20.0, baseline=True))
    labels = {"model": "m", "domain": "legal", "target": "t"}
    get = metrics.registry.get_sample_value
    assert get("prunewatch_latency_vs_dense_pairs", {**labels, "phase": "decode"}) == 2.0
    estimate = get("prunewatch_latency_vs_dense_window", {**labels, "phase": "decode", "bound": "estimate"})
    assert math.isclose(estimate, (0.1 + 0.08) / 0.1)
    low = get("prunewatch_latency_vs_dense_window", {**labels, "phase": "decode", "bound": "low"})
    high = get("prunewatch_latency_vs_dense_window", {**labels, "phase": "decode", "bound": "high"})
    assert math.isclose(low, 1.6) and math.isclose(high, 2.0)  # the two pairs' own ratios bound the resamples
    assert get("prunewatch_latency_vs_dense_window", {**labels, "phase": "first_token", "bound": "estimate"}) == 1.0
