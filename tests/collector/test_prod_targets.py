"""HTTP targets (a real prunewatch engine server, a plain OpenAI-compatible baseline) and probe deadlines."""

from __future__ import annotations

import threading
import time

import pytest
from sqlalchemy import text

from prunewatch.collector.exporters import SqlExporter
from prunewatch.collector.http_target import HttpTarget, parse_stats_header
from prunewatch.collector.in_process import InProcessTarget
from prunewatch.collector.probe_round import run_round
from prunewatch.collector.targets import ProbeCancelledError
from prunewatch.probes import ProbeSet
from prunewatch.records.store import connect, create_schema
from prunewatch.server.app import create_app
from prunewatch.server.settings import ServerSettings
from tests.collector.prod_helpers import (
    PROBES,
    SMALL_PROBES,
    FakeTarget,
    baseline_server,
    serving,
)

KEY = "sk-collector-test"


class Recorder:
    def __init__(self) -> None:
        self.results = []

    def record(self, result) -> None:
        self.results.append(result)


@pytest.fixture(scope="module")
def engine_url(probe_engine):
    with serving(create_app(probe_engine, ServerSettings(api_keys=[KEY], workers=1))) as url:
        yield url


def test_prunewatch_server_figures_equal_the_engine_run_directly(engine_url, probe_engine):
    probe = SMALL_PROBES.probes[0]
    target = HttpTarget(name="gpu-a", base_url=engine_url, model=probe_engine.name, api_key=KEY, sensitivity=0.5)
    summary = run_round(target, ProbeSet((probe,), "t"), [Recorder()], timeout_s=60)
    (result,) = summary.results
    direct = probe_engine.generate(probe.prompt, system=probe.system, max_new_tokens=probe.max_tokens,
                                   sensitivity=0.5).stats  # greedy: the same tokens, the same plan
    assert result.status == "ok", result.error_message
    assert (result.target, result.model, result.sensitivity, result.ratio_source, result.ratio_unit) == (
        "gpu-a", probe_engine.name, 0.5, "measured", "linear_flops")
    assert result.pruning_ratio == direct.pruning_ratio and result.pruning_ratio > 0
    assert (result.layers_bypassed, result.executed_flops, result.dense_flops, result.layers_total) == (
        direct.layers_bypassed, direct.executed_flops, direct.dense_flops, direct.layers_total)
    assert (result.prompt_tokens, result.completion_tokens, result.matched_domain) == (
        direct.prompt_tokens, direct.completion_tokens, direct.domain)
    assert result.inference_ms > 0 and result.preprocessing_ms > 0 and result.ttft_ms > 0
    # the collector asks for quality (X-Pruning-Quality: on): scored on the server, same figures as in-process
    quality = probe_engine.generate(probe.prompt, system=probe.system, max_new_tokens=probe.max_tokens,
                                    sensitivity=0.5, quality=True).stats
    assert (result.continuation_agreement, result.perplexity_delta_pct) == (
        quality.quality.continuation_agreement, quality.quality.perplexity_delta_pct)
    assert result.quality_ms > 0
    assert (result.prefill_pruning_ratio, result.decode_pruning_ratio) == (
        direct.prefill_pruning_ratio, direct.decode_pruning_ratio)
    assert result.duration_ms >= result.inference_ms


def test_sensitivity_zero_is_a_measured_zero_not_absent(engine_url, probe_engine):
    target = HttpTarget(name="gpu-a", base_url=engine_url, model=probe_engine.name, api_key=KEY, sensitivity=0.0)
    (result,) = run_round(target, ProbeSet(SMALL_PROBES.probes[1:], "t"), [], timeout_s=60).results
    assert (result.status, result.pruning_ratio, result.layers_bypassed, result.sensitivity) == ("ok", 0.0, [], 0.0)


def test_wrong_key_and_unknown_model_are_labelled_failures(engine_url, probe_engine):
    probes = ProbeSet(SMALL_PROBES.probes[:1], "t")
    wrong_key = HttpTarget(name="a", base_url=engine_url, model=probe_engine.name, api_key="sk-wrong")
    (failed,) = run_round(wrong_key, probes, [], timeout_s=30).results
    assert (failed.status, failed.failure_reason) == ("failed", "auth")
    assert failed.error_message.startswith("TargetAuthError: HTTP 401: ")
    with pytest.raises(Exception, match="HTTP 401"):
        wrong_key.list_models()
    good = HttpTarget(name="a", base_url=engine_url, model=probe_engine.name, api_key=KEY)
    assert good.list_models() == [probe_engine.name]


def test_baseline_server_ratio_is_stored_as_null_not_zero(tmp_path):
    with baseline_server() as (url, seen):
        target = HttpTarget(name="vllm", base_url=url, model="baseline-model", kind="openai")
        db = connect(f"sqlite:///{tmp_path / 's.db'}")
        create_schema(db)
        summary = run_round(target, ProbeSet(PROBES.probes[:2], "t"), [SqlExporter(db)], timeout_s=10)
    assert [r.status for r in summary.results] == ["ok", "ok"]
    headers, body = seen[0]
    assert not any(h.lower().startswith("x-pruning") for h in headers)  # a baseline is never asked to prune
    assert body["model"] == "baseline-model" and body["max_tokens"] == 4 and body["temperature"] == 0.0
    with db.connect() as connection:
        rows = connection.execute(text(
            "SELECT pruning_ratio IS NULL, ratio_source IS NULL, inference_ms IS NULL, sensitivity IS NULL, "
            "prompt_tokens, completion_tokens, output_text, duration_ms > 0 FROM probe_results")).all()
    assert [tuple(r) for r in rows] == [(1, 1, 1, 1, 11, 3, "plain answer", 1)] * 2
    db.dispose()


def test_unreachable_and_slow_servers_fail_with_their_reason():
    probes = ProbeSet(PROBES.probes[:1], "t")
    nobody = HttpTarget(name="x", base_url="http://127.0.0.1:9", model="m", kind="openai", timeout_s=2)
    (result,) = run_round(nobody, probes, [], timeout_s=5).results
    assert (result.status, result.failure_reason) == ("failed", "unreachable")
    with baseline_server(delay_s=1.0) as (url, _):
        slow = HttpTarget(name="x", base_url=url, model="m", kind="openai", timeout_s=0.3)
        (result,) = run_round(slow, probes, [], timeout_s=5).results
    assert (result.status, result.failure_reason) == ("failed", "timeout")
    assert 250 <= result.duration_ms < 1000


def test_overrun_probe_is_one_timeout_result_and_its_late_answer_is_dropped():
    target = FakeTarget(slow={"legal-1": 0.6}, delay_s=0.0)
    recorder = Recorder()
    started = time.perf_counter()
    summary = run_round(target, ProbeSet(PROBES.probes[:2], "t"), [recorder], timeout_s=0.15, cancel_grace_s=0.0)
    assert time.perf_counter() - started < 0.5  # the round did not wait for the slow probe
    assert [(r.probe_id, r.status, r.failure_reason) for r in recorder.results] == [
        ("legal-1", "failed", "timeout"), ("legal-2", "ok", None)]
    assert 150 <= recorder.results[0].duration_ms < 450
    deadline = time.monotonic() + 5
    while target.finished < 2 and time.monotonic() < deadline:  # the abandoned probe still completes...
        time.sleep(0.02)
    assert target.finished == 2
    assert len(recorder.results) == 2 and len(summary.results) == 2  # ...and is recorded nowhere


def test_in_process_probe_stops_at_the_next_token_when_cancelled(probe_engine):
    cancel = threading.Event()
    cancel.set()
    target = InProcessTarget(probe_engine, name="embedded", sensitivity=0.5)
    with pytest.raises(ProbeCancelledError, match="cancelled after its timeout"):
        target.run_probe(SMALL_PROBES.probes[0], cancel=cancel)
    (result,) = run_round(target, ProbeSet(SMALL_PROBES.probes[:1], "t"), [], timeout_s=0.001).results
    assert (result.status, result.failure_reason) == ("failed", "timeout")
    assert not [t for t in threading.enumerate() if t.name.startswith("prunewatch-probe")]  # wound down in grace


def test_stats_header_parsing():
    assert parse_stats_header("layers_bypassed=3,heads_gated=0,sparsity=0.25,total_tokens=40") == {
        "layers_bypassed": 3.0, "heads_gated": 0.0, "sparsity": 0.25, "total_tokens": 40.0}
    assert parse_stats_header(None) == {} and parse_stats_header("junk,a=nan,b=") == {}
