"""Measured before and after: HTTP targets timed by the collector, dense baselines, ROI from measured dense time.

The server probed over HTTP is the engine's plain OpenAI route reached as a `kind: openai` target:
no pruning headers are sent, and every figure checked here is the collector's own stopwatch on the
stream, which is what a llama.cpp or vLLM server would get too.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from statistics import fmean

import httpx
import pytest
from prometheus_client import CollectorRegistry
from sqlalchemy.orm import Session

import prunewatch.collector.http_target as http_target
from prunewatch.collector.fleet import FleetSettings, run_collector
from prunewatch.collector.http_target import HttpTarget, StreamTiming, read_event_stream
from prunewatch.collector.in_process import InProcessTarget
from prunewatch.collector.scheduler import TargetJob
from prunewatch.probes import Probe
from prunewatch.records.metrics import CollectorMetrics
from prunewatch.records.store import ResultRepository, connect
from prunewatch.roi import Assumptions, Window, calculate
from prunewatch.roi.provenance import Provenance
from prunewatch.server.app import create_app
from prunewatch.server.settings import ServerSettings
from tests.collector.prod_helpers import SMALL_PROBES, serving

PROBE = Probe(id="p", domain="tech", version=1, max_tokens=8, system="", prompt="hi")


def _sse(*chunks: str) -> list[str]:
    return [f"data: {chunk}" for chunk in chunks] + ["data: [DONE]"]


def test_stream_timing_is_read_from_when_content_arrived(monkeypatch):
    """TTFT is send -> first content; decode speed counts the tokens after the first over first -> last."""
    clock = iter([10.0, 10.25, 10.5, 11.25])  # first content at +0.25 s, more at +0.5 s, last at +1.25 s
    monkeypatch.setattr(http_target.time, "perf_counter", lambda: next(clock))
    timing = StreamTiming(started=http_target.time.perf_counter())
    lines = _sse('{"choices": [{"delta": {"role": "assistant", "content": ""}}]}',
                 '{"choices": [{"delta": {"content": "Hel"}}]}',
                 '{"choices": [{"delta": {"content": "lo"}}]}',
                 '{"choices": [{"delta": {"content": "!"}}], "model": "m"}',
                 '{"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 7}}')
    body = read_event_stream(iter([": keep-alive", "", *lines]), timing)
    assert body["choices"][0]["message"]["content"] == "Hello!" and body["usage"]["completion_tokens"] == 7
    assert timing.ttft_ms() == 250.0 and timing.content_chunks == 3
    assert timing.decode_tokens_per_s(7) == pytest.approx(6 / 1.0)  # 6 tokens after the first in 1.0 s
    assert timing.decode_tokens_per_s(1) is None  # one token: no decode interval to time


@pytest.mark.parametrize("stream, error", [
    (['data: {"error": {"message": "out of memory", "type": "server_error"}}'], "HTTP 500: out of memory"),
    (["data: not json"], "a stream event is not JSON"),
    (["data: [DONE]"], "the stream ended without a chat completion chunk"),
])
def test_a_broken_stream_is_a_failure_with_its_reason(stream, error):
    with pytest.raises(http_target.TargetError, match=error):
        read_event_stream(iter(stream), StreamTiming(started=0.0))


def test_a_server_that_ignores_stream_is_read_as_one_body():
    def handler(request: httpx.Request) -> httpx.Response:
        assert b'"stream":true' in request.content.replace(b" ", b"")
        return httpx.Response(200, json={"model": "m", "choices": [{"message": {"content": "ok"}}],
                                         "usage": {"completion_tokens": 1}})

    target = HttpTarget(name="b", base_url="http://x", model="m", kind="openai",
                        transport=httpx.MockTransport(handler))
    observation = target.run_probe(PROBE)
    assert observation.text == "ok" and observation.fields.get("client_ttft_ms") is None


@pytest.mark.integration
def test_openai_target_stores_client_ttft_decode_speed_and_total_time(probe_engine, tmp_path):
    store = f"sqlite:///{tmp_path / 'client.db'}"
    metrics = CollectorMetrics(CollectorRegistry())
    with serving(create_app(probe_engine, ServerSettings())) as base_url:
        job = TargetJob(HttpTarget(name="plain", base_url=base_url, model=probe_engine.name, kind="openai",
                                   timeout_s=120), SMALL_PROBES, interval_s=3600, timeout_s=120)
        outcome = run_collector(FleetSettings(db_url=store, buffer_path=tmp_path / "b.sqlite", rounds=1,
                                              metrics_port=0), [job], metrics=metrics)
    assert (outcome.results, outcome.failures) == (len(SMALL_PROBES.probes), 0)
    engine = connect(store)
    with Session(engine) as session:
        stored = ResultRepository(session).list()
    engine.dispose()
    for result in stored:
        assert result.completion_tokens and result.completion_tokens > 1
        assert 0 < result.client_ttft_ms < result.duration_ms  # first token before the whole probe ended
        assert result.client_decode_tokens_per_s > 0
        # decode time implied by the speed fits between the first token and the end of the probe
        decode_ms = (result.completion_tokens - 1) / result.client_decode_tokens_per_s * 1000
        assert result.client_ttft_ms + decode_ms <= result.duration_ms + 1e-6
        assert not result.baseline
    labels = {"model": probe_engine.name, "domain": stored[0].domain, "target": "plain"}
    assert metrics.registry.get_sample_value("prunewatch_client_time_to_first_token_seconds_count", labels) >= 1
    assert metrics.registry.get_sample_value("prunewatch_client_decode_tokens_per_second", labels) > 0


@pytest.mark.integration
def test_baselines_make_the_reports_before_figure_measured(probe_engine, tmp_path):
    """Baselines every 2 rounds over 3 rounds: rounds 1 and 3 also run dense, and ROI's 'before' is their mean."""
    store = f"sqlite:///{tmp_path / 'baseline.db'}"
    started = datetime.now(UTC)
    metrics = CollectorMetrics(CollectorRegistry())
    job = TargetJob(InProcessTarget(probe_engine, name="embedded", sensitivity=0.5), SMALL_PROBES, interval_s=0.2,
                    baseline_every=2)
    outcome = run_collector(FleetSettings(db_url=store, buffer_path=tmp_path / "b.sqlite", rounds=3,
                                          metrics_port=0), [job], metrics=metrics)
    probes = len(SMALL_PROBES.probes)
    assert (outcome.rounds, outcome.results, outcome.failures) == (3, 3 * probes + 2 * probes, 0)
    engine = connect(store)
    with Session(engine) as session:
        stored = ResultRepository(session).list()
    engine.dispose()
    dense = [r for r in stored if r.baseline]
    pruned = [r for r in stored if not r.baseline]
    assert len(dense) == 2 * probes and all(r.sensitivity == 0 and r.pruning_ratio == 0 for r in dense)
    assert all(r.reference_agreement is None for r in dense)  # no quality check of dense against itself
    assert all(r.sensitivity == 0.5 and r.reference_agreement is not None for r in pruned)
    assert len({r.round_id for r in dense}) == 2

    window = Window(start=started - timedelta(minutes=1), end=datetime.now(UTC) + timedelta(minutes=1))
    summary, result = calculate(stored, window, Assumptions())
    per_probe = [fmean(r.inference_ms for r in dense if r.probe_id == p.id) for p in SMALL_PROBES.probes]
    before = result.inputs.dense_inference_s
    assert before.provenance is Provenance.MEASURED and before.value == pytest.approx(fmean(per_probe) / 1000)
    assert result.gpu_time.before_provenance is Provenance.MEASURED
    assert result.gpu_time.before_s == pytest.approx(fmean(per_probe) / 1000)
    assert summary.dense_results == 2 * probes and summary.matched_probes == probes
    # The dense runs feed their own latency family; the pruned figures are the pruned runs' alone.
    domain = SMALL_PROBES.probes[0].domain
    labels = {"model": probe_engine.name, "domain": domain, "target": "embedded"}
    dense_in_domain = sum(r.domain == domain for r in dense)
    assert metrics.registry.get_sample_value("prunewatch_dense_inference_latency_seconds_count", labels) == \
        dense_in_domain
    assert metrics.registry.get_sample_value("prunewatch_inference_latency_seconds_count", labels) == \
        sum(r.domain == domain for r in pruned)
