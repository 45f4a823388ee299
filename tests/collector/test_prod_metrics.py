"""The collector's registry: probe duration, buffer families, and the optional Pushgateway push."""

from __future__ import annotations

import socket
import urllib.error
import urllib.request

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from prunewatch.collector.fleet import FleetSettings, run_collector
from prunewatch.collector.pushgateway import Pushgateway
from prunewatch.collector.scheduler import TargetJob
from prunewatch.records.metrics import CollectorMetrics
from tests.collector.factories import ok_result
from tests.collector.prod_helpers import (
    PROBES,
    FakeTarget,
    pushgateway_binary,
    pushgateway_server,
)


def test_probe_duration_counts_every_status_per_target():
    metrics = CollectorMetrics(CollectorRegistry())
    metrics.record(ok_result(target="gpu-a", duration_ms=1500.0))
    metrics.record(ok_result(target="gpu-a", status="failed", failure_reason="timeout", duration_ms=30_000.0))
    get = metrics.registry.get_sample_value
    labels = {"model": "probe-llama", "target": "gpu-a"}
    assert get("prunewatch_probe_duration_seconds_count", {**labels, "status": "ok"}) == 1
    assert get("prunewatch_probe_duration_seconds_sum", {**labels, "status": "ok"}) == 1.5
    assert get("prunewatch_probe_duration_seconds_bucket", {**labels, "status": "ok", "le": "2.0"}) == 1
    assert get("prunewatch_probe_duration_seconds_bucket", {**labels, "status": "ok", "le": "1.0"}) == 0
    assert get("prunewatch_probe_duration_seconds_bucket", {**labels, "status": "failed", "le": "30.0"}) == 1


def test_buffer_families_exist_only_where_a_buffer_is_tracked():
    plain = CollectorMetrics(CollectorRegistry())  # e.g. the engine server, which shares these families
    assert b"prunewatch_collector_buffer_depth" not in generate_latest(plain.registry)
    depth = {"n": 7}
    tracked = CollectorMetrics(CollectorRegistry())
    tracked.track_buffer(lambda: depth["n"])
    assert tracked.registry.get_sample_value("prunewatch_collector_buffer_depth") == 7
    depth["n"] = 0  # read at scrape time, never stale
    assert tracked.registry.get_sample_value("prunewatch_collector_buffer_depth") == 0


def test_unreachable_pushgateway_is_logged_not_fatal(caplog):
    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    pusher = Pushgateway(url, CollectorMetrics(CollectorRegistry()).registry, timeout_s=2)
    assert pusher.push() is False and pusher.failures == 1
    assert "push to the Pushgateway" in caplog.text
    with pytest.raises(ValueError, match="must start with http:// or https://"):
        Pushgateway("localhost:9091", CollectorRegistry())


@pytest.mark.integration
@pytest.mark.skipif(pushgateway_binary() is None, reason="prometheus-pushgateway not installed")
def test_short_run_pushes_its_samples_to_a_real_pushgateway(tmp_path):
    with pushgateway_server(tmp_path) as gateway:
        settings = FleetSettings(db_url=f"sqlite:///{tmp_path / 's.db'}", buffer_path=tmp_path / "b.sqlite",
                                 rounds=1, metrics_port=0, pushgateway_url=gateway, pushgateway_job="pw_test")
        outcome = run_collector(settings, [TargetJob(FakeTarget(), PROBES, interval_s=3600)])
        with urllib.request.urlopen(f"{gateway}/metrics", timeout=5) as response:
            body = response.read().decode()
    assert outcome.results == 6
    pushed = [line for line in body.splitlines() if line.startswith("prunewatch_probe_results_total{")]
    assert len(pushed) == 3 and all('job="pw_test"' in line and 'status="ok"' in line for line in pushed)
    assert sum(float(line.rsplit(" ", 1)[1]) for line in pushed) == 6.0
    assert any(line.startswith("prunewatch_collector_buffer_depth{") and line.endswith(" 0") for line in body.splitlines())


def test_metrics_server_renders_once_per_change_and_never_serves_stale_samples():
    import gzip

    from prunewatch.collector.exposition import start_metrics_server

    metrics = CollectorMetrics(CollectorRegistry())
    depth = {"n": 0}
    metrics.track_buffer(lambda: depth["n"])
    server, thread = start_metrics_server(metrics, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.server_address[1]}/metrics"

    def scrape(gz: bool = False) -> str:
        request = urllib.request.Request(url, headers={"Accept-Encoding": "gzip"} if gz else {})
        with urllib.request.urlopen(request, timeout=5) as response:
            body = response.read()
            return (gzip.decompress(body) if response.headers.get("Content-Encoding") == "gzip" else body).decode()

    def value(body: str, prefix: str) -> float:
        return sum(float(line.rsplit(" ", 1)[1]) for line in body.splitlines() if line.startswith(prefix))

    try:
        first = scrape()
        assert scrape() == first and scrape(gz=True) == first
        assert server.exposition.renders == 1  # three scrapes, one render
        metrics.record(ok_result(target="gpu-a"))
        assert value(scrape(), "prunewatch_probe_results_total{") == 1.0
        depth["n"] = 5  # the buffer moved without a new result: still current
        assert value(scrape(), "prunewatch_collector_buffer_depth ") == 5.0
        metrics.count_store_error("unavailable")
        assert value(scrape(), "prunewatch_collector_store_write_errors_total{") == 1.0
        assert server.exposition.renders == 4
        with pytest.raises(urllib.error.HTTPError, match="404"):
            urllib.request.urlopen(url.replace("/metrics", "/other"), timeout=5)
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)
