"""The store-derived series equal what CollectorMetrics exposes for the same results (no drift from metrics.py)."""

from __future__ import annotations

import math
from datetime import timedelta

from prometheus_client import CollectorRegistry
from sqlalchemy.orm import Session

from prunewatch.alerts._series import GAUGES, NAME, WINDOW_GAUGES, StoreSeries, counter_names
from prunewatch.records.metrics import CollectorMetrics
from prunewatch.records.results import FAILURE_REASONS, ProbeResult
from prunewatch.records.store import ResultRepository, connect
from tests.alerts.conftest import T0, result


def exposed(results: list[ProbeResult]) -> dict[tuple, float]:
    """Every sample CollectorMetrics exposes after recording `results` (creation timestamps left out)."""
    metrics = CollectorMetrics(registry=CollectorRegistry())
    for r in results:
        metrics.record(r)
    out = {}
    for family in metrics.registry.collect():
        for sample in family.samples:
            if sample.name.endswith("_created"):
                continue
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def derived(results: list[ProbeResult]) -> dict[tuple, float]:
    """The same samples as the evaluator sees them at the newest result: last gauge values, counter totals."""
    series = StoreSeries(results)
    out = {}
    end = max(r.created_at for r in results).timestamp()
    for metric in (*GAUGES, *WINDOW_GAUGES):
        for s in series.gauges(metric):
            out[(metric, tuple(kv for kv in s.labels if kv[0] != NAME))] = s.values[-1]
    for metric in counter_names():
        for s in series.counters(metric):
            out[(metric, tuple(kv for kv in s.labels if kv[0] != NAME))] = s.increase(-math.inf, end)
    return out


def assert_same(results: list[ProbeResult]) -> None:
    want, got = exposed(results), derived(results)
    assert sorted(got) == sorted(want)
    for key, value in want.items():
        assert math.isclose(got[key], value, rel_tol=1e-12), key


def test_synthetic_results_map_to_the_collector_metrics() -> None:
    results = [
        result(T0, "legal", "legal-1", ratio=0.31, inference_ms=950.0),
        result(T0 + timedelta(seconds=1), "legal", "legal-2", ratio=None, agreement=None, inference_ms=None),
        result(T0 + timedelta(seconds=2), "tech", "tech-1", ratio=0.5, inference_ms=80.0),
        result(T0 + timedelta(seconds=3), "tech", "tech-1", ratio=0.45, inference_ms=6000.0),
        result(T0 + timedelta(seconds=4), "tech", "tech-2", status="failed", reason="timeout"),
        result(T0 + timedelta(seconds=5), "tech", "tech-2", status="failed", reason=None),
    ]
    results[0].tokens_per_s, results[0].dram_bytes_per_instruction, results[0].dram_source = 20.5, 3.5, "ncu"
    results[2].preprocessing_ms, results[2].postprocessing_ms, results[2].ttft_ms = 2.0, 30.0, 75.0
    results[2].prefill_pruning_ratio, results[2].decode_pruning_ratio, results[2].quality_ms = 0.0, 0.42, 1500.0
    results[2].client_ttft_ms, results[2].client_decode_tokens_per_s = 120.0, 31.5
    dense = result(T0 + timedelta(seconds=6), "tech", "tech-1", ratio=0.0, inference_ms=9000.0)
    dense.baseline, dense.sensitivity, dense.client_ttft_ms = True, 0.0, 240.0
    results.append(dense)
    for i, (probe, pruned_tps) in enumerate((("tech-3", 20.0), ("tech-4", 16.0))):  # a baseline round's pairs
        for j, (tps, baseline) in enumerate(((pruned_tps, False), (25.0, True))):
            run = result(T0 + timedelta(seconds=7 + 2 * i + j), "tech", probe, ratio=0.0 if baseline else 0.4)
            run.round_id, run.baseline, run.sensitivity = "p" * 32, baseline, 0.0 if baseline else 0.5
            run.decode_tokens_per_s, run.ttft_ms, run.prompt_tokens = tps, 30.0 if baseline else 33.0, 12
            results.append(run)
    for r in results:
        r.duration_ms = 1234.0
    assert_same(results)
    series = StoreSeries(results)
    ratios = {s.values[-1] for s in series.gauges("prunewatch_pruning_ratio") if ("probe", "tech-1") in s.labels}
    assert ratios == {0.45}  # a dense baseline does not overwrite the pruned configuration's ratio
    dense_count = series.counters("prunewatch_dense_inference_latency_seconds_count")
    assert [sum(s.increments) for s in dense_count] == [3.0]  # tech-1 and the two pairs' dense runs
    series = StoreSeries(results)
    failures = {dict(s.labels)["reason"] for s in series.counters("prunewatch_probe_failures_total") if sum(s.increments)}
    assert failures == {"timeout", "exception"}  # a failure without a reason is counted as "exception"
    # Every reason exists (at 0) from the first result of its target, model and domain, as the exporter's do.
    legal = {dict(s.labels)["reason"] for s in series.counters("prunewatch_probe_failures_total")
             if dict(s.labels)["domain"] == "legal"}
    assert legal == set(FAILURE_REASONS)


def test_real_collector_results_map_to_the_collector_metrics(collected_sqlite: str) -> None:
    engine = connect(collected_sqlite)
    try:
        with Session(engine) as session:
            results = ResultRepository(session).list()
    finally:
        engine.dispose()
    assert len(results) >= 6 and all(r.ok for r in results)
    assert_same(results)


def test_the_latency_window_stays_present_between_baseline_rounds() -> None:
    """The collector keeps exporting the last paired ratio; the replay samples it again at every later result of
    the same target, model and domain, so a rule's `for:` can span the rounds between two baseline rounds."""
    results = []
    for step, (probe, baseline) in enumerate((("legal-1", False), ("legal-1", True), ("legal-2", True),
                                              ("legal-2", False))):
        run = result(T0 + timedelta(seconds=step), "legal", probe)
        run.round_id, run.baseline, run.sensitivity = "b" * 32, baseline, 0.0 if baseline else 0.5
        run.decode_tokens_per_s = 25.0 if baseline else 10.0
        results.append(run)
    later = [result(T0 + timedelta(minutes=m), "legal", "legal-1") for m in (4, 8, 12)]  # ordinary rounds
    for r in later:
        r.round_id, r.sensitivity = f"{len(results):032d}", 0.5
        results.append(r)
    (low,) = [s for s in StoreSeries(results).gauges("prunewatch_latency_vs_dense_window")
              if ("bound", "low") in s.labels and ("phase", "decode") in s.labels]
    assert low.times[-3:] == [r.created_at.timestamp() for r in later]
    assert low.values[0] == 0.0  # one pair: no claim on the spread
    assert low.values[-4:] == [2.5] * 4  # two pairs, both 2.5x dense: so is the lower bound, held since
