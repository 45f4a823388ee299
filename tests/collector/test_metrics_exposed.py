"""The collector's metrics carry the documented names, labels and buckets, and are served on /metrics."""

import urllib.request

import pytest
from prometheus_client import CollectorRegistry, start_http_server

from prunewatch.records.metrics import LATENCY_BUCKETS, CollectorMetrics
from prunewatch.records.results import FAILURE_REASONS
from tests.collector.factories import ok_result
from tests.support.servers import free_port


def test_samples_after_one_ok_and_one_failed_result():
    metrics = CollectorMetrics(CollectorRegistry())
    metrics.record(ok_result())
    metrics.record(ok_result(status="failed", failure_reason="timeout", result_id="f" * 32))
    get = metrics.registry.get_sample_value
    labels = {"model": "probe-llama", "domain": "tech", "target": "embedded"}
    assert get("prunewatch_pruning_ratio", {**labels, "probe": "tech-route"}) == 0.3125
    assert get("prunewatch_tokens_per_second", labels) == 19.04
    assert get("prunewatch_inference_latency_seconds_count", labels) == 1
    assert get("prunewatch_inference_latency_seconds_sum", labels) == pytest.approx(0.42025)
    assert get("prunewatch_inference_latency_seconds_bucket", {**labels, "le": "0.3"}) == 0
    assert get("prunewatch_inference_latency_seconds_bucket", {**labels, "le": "0.5"}) == 1
    assert get("prunewatch_probe_failures_total", {**labels, "reason": "timeout"}) == 1
    assert get("prunewatch_probe_results_total", {**labels, "status": "ok"}) == 1
    assert get("prunewatch_continuation_agreement", {**labels, "probe": "tech-route"}) == 0.875
    assert get("prunewatch_dram_bytes_per_instruction", {**labels, "source": "estimate"}) == 5.5


def test_failure_counters_exist_at_zero_before_the_first_failure():
    """rate() and increase() need a sample before an increment: a failures series born at 1 would hide the first
    failure of a target from the failure-rate alert, so every known reason starts at 0 with the first result."""
    metrics = CollectorMetrics(CollectorRegistry())
    metrics.record(ok_result())
    get = metrics.registry.get_sample_value
    labels = {"model": "probe-llama", "domain": "tech", "target": "embedded"}
    assert {reason: get("prunewatch_probe_failures_total", {**labels, "reason": reason})
            for reason in FAILURE_REASONS} == dict.fromkeys(FAILURE_REASONS, 0.0)
    metrics.record(ok_result(status="failed", failure_reason="unreachable", result_id="f" * 32))
    assert get("prunewatch_probe_failures_total", {**labels, "reason": "unreachable"}) == 1
    assert get("prunewatch_probe_failures_total", {**labels, "reason": "timeout"}) == 0
    live = CollectorMetrics(CollectorRegistry())
    live.record(ok_result(), live=True)  # served traffic is not probing: no failure series at all
    assert live.registry.get_sample_value("prunewatch_probe_failures_total", {**labels, "reason": "timeout"}) is None


def test_every_failure_reason_the_collector_gives_is_preset():
    from prunewatch.collector.http_target import TargetHTTPError
    from prunewatch.collector.probe_round import classify_failure
    from prunewatch.collector.targets import TargetError
    from prunewatch.engine.errors import EngineError, InvalidRequestError

    def subclasses(cls):
        for sub in cls.__subclasses__():
            yield sub
            yield from subclasses(sub)

    reasons = {sub.reason for sub in subclasses(TargetError)} | {TargetError.reason}
    reasons |= {TargetHTTPError(status, "x").reason for status in (400, 404, 429, 500, 503)}
    reasons |= {classify_failure(exc) for exc in (TimeoutError(), InvalidRequestError("x"), EngineError("x"),
                                                  ConnectionError(), ValueError())}
    assert reasons == set(FAILURE_REASONS)


def test_latency_buckets_are_the_documented_ones():
    assert LATENCY_BUCKETS == (0.1, 0.3, 0.5, 0.8, 1.2, 2.0, 5.0)


def test_absent_ratio_is_not_exported_as_zero():
    metrics = CollectorMetrics(CollectorRegistry())
    metrics.record(ok_result(pruning_ratio=None, ratio_source=None))
    assert metrics.registry.get_sample_value(
        "prunewatch_pruning_ratio", {"model": "probe-llama", "domain": "tech", "probe": "tech-route",
                                     "target": "embedded"}) is None


def test_two_targets_serving_the_same_model_keep_separate_series():
    metrics = CollectorMetrics(CollectorRegistry())
    metrics.record(ok_result(target="gpu-a", pruning_ratio=0.40))
    metrics.record(ok_result(target="gpu-b", pruning_ratio=0.20, result_id="b" * 32))
    get = metrics.registry.get_sample_value
    labels = {"model": "probe-llama", "domain": "tech", "probe": "tech-route"}
    assert get("prunewatch_pruning_ratio", {**labels, "target": "gpu-a"}) == 0.40
    assert get("prunewatch_pruning_ratio", {**labels, "target": "gpu-b"}) == 0.20
    for target in ("gpu-a", "gpu-b"):
        assert get("prunewatch_inference_latency_seconds_count",
                   {"model": "probe-llama", "domain": "tech", "target": target}) == 1


def test_served_over_http():
    metrics = CollectorMetrics(CollectorRegistry())
    metrics.record(ok_result())
    port = free_port()
    server, _ = start_http_server(port, addr="127.0.0.1", registry=metrics.registry)
    try:
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    finally:
        server.shutdown()
    assert 'prunewatch_pruning_ratio{domain="tech",model="probe-llama",probe="tech-route",target="embedded"} 0.3125' in body
    assert ('prunewatch_inference_latency_seconds_bucket{domain="tech",le="0.8",model="probe-llama",target="embedded"} 1.0'
            in body)
    assert "# TYPE prunewatch_probe_failures_total counter" in body
    assert "# TYPE prunewatch_tokens_per_second gauge" in body
