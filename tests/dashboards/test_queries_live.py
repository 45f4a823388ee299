"""Every panel query of every dashboard returns data from a real Prometheus and a real PostgreSQL.

A real collector run feeds both: probe rounds of the embedded engine (and of a misconfigured
target whose probes really fail) go through `run_round` into the collector's metrics, served by
prometheus_client and scraped every second by a real Prometheus that loads the alert rule file,
and into PostgreSQL through the SqlExporter. Each target of each panel is then expanded the way
Grafana expands it (template variables, intervals, SQL macros) and executed: PromQL through
/api/v1/query, SQL through psycopg. Key figures are compared with values computed independently
from the probe results.
"""

from __future__ import annotations

import json
import math
import threading
import time
import urllib.parse
import urllib.request
import uuid
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from typing import Any

import numpy as np
import pytest
import yaml
from prometheus_client import CollectorRegistry, start_http_server
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

from prunewatch.alerts.settings import RULES_PATH
from prunewatch.collector.exporters import SqlExporter
from prunewatch.collector.governor import Governor, GovernorSettings
from prunewatch.collector.in_process import InProcessTarget
from prunewatch.collector.probe_round import run_round
from prunewatch.dashboards import build_dashboards, panel_queries, template_variables
from prunewatch.dashboards.rules import load_rule_file, parse_bucket
from prunewatch.dashboards.settings import DashboardSettings
from prunewatch.engine.batching import STEPPER_ACTIVITIES
from prunewatch.probes import Probe, ProbeSet, load_probes
from prunewatch.records.governor_metrics import GovernorMetrics
from prunewatch.records.metrics import CollectorMetrics
from prunewatch.records.results import ProbeResult
from prunewatch.records.store import connect, create_schema
from prunewatch.server.metrics import ServerMetrics
from tests.alerts.conftest import measured_range
from tests.dashboards.grafana_expand import Selection, expand_promql, expand_sql
from tests.support.servers import free_port, prometheus_server

pytestmark = pytest.mark.integration

DEADLINE_S = 60.0
FIRING_ALERT = "ProbeFailing"
DOMAINS = ("legal", "tech")
ANOMALOUS_PROMPT = "Explain what this log line means: ################ ERROR ################"
SERVED_PROMPTS = ("What is a contract?", "Explain how a CPU cache works.", "Describe bond yields in simple words.")
KV_BUDGET_BYTES = 64 * 2**20


@dataclass
class LiveStack:
    prometheus_url: str
    db_url: str
    results: list[ProbeResult]  # the pruned configuration's: what every pruned figure is computed from
    baselines: list[ProbeResult]  # the dense runs of the healthy rounds
    rounds: int
    started: datetime
    model: str
    settings: DashboardSettings
    served_steps: dict[int, int]  # the batcher's decode steps by rows in the step, at the end of the run

    def selection(self, values: dict[str, list[str]]) -> Selection:
        """The dashboard with its time range set to the run: queries are evaluated as instants at the
        end of the run, with $__rate_interval and $__range spanning the whole run (what the last point
        of a panel shows for that range), $__interval 1s (the scrape interval)."""
        now = datetime.now(UTC)
        window = f"{math.ceil((now - self.started).total_seconds()) + 5}s"
        return Selection(values=values,
                         constants={"usd_per_million_tokens": f"{self.settings.usd_per_million_tokens:g}",
                                    "gpu_usd_per_hour": f"{self.settings.gpu_usd_per_hour:g}"},
                         time_from=self.started - timedelta(seconds=5), time_to=now + timedelta(seconds=1),
                         interval="1s", rate_interval=window)


# -- helpers ---------------------------------------------------------------------------------------
def _get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as response:
        body = json.load(response)
    assert body["status"] == "success", body
    return body["data"]


def prom_query(base: str, expr: str) -> list[dict]:
    data = _get(f"{base}/api/v1/query?" + urllib.parse.urlencode({"query": expr}))
    if data["resultType"] == "scalar":
        return [{"metric": {}, "value": data["result"]}]
    return data["result"]


def prom_label_values(base: str, label: str, match: str) -> list[str]:
    return _get(f"{base}/api/v1/label/{label}/values?" + urllib.parse.urlencode({"match[]": match}))


def _poll(condition, what: str, timeout_s: float = DEADLINE_S, interval_s: float = 0.2):
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        last = condition()
        if last:
            return last
        time.sleep(interval_s)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what} (last: {last!r})")


def _scraped_total(base: str, expected: int) -> bool:
    result = prom_query(base, "sum(prunewatch_probe_results_total)")
    return bool(result) and float(result[0]["value"][1]) == expected


def _scraped_steps(base: str, expected: int) -> bool:
    result = prom_query(base, "sum(prunewatch_decode_steps_total)")
    return bool(result) and float(result[0]["value"][1]) == expected


def _serve_together(engine, batcher) -> None:
    """Short dense requests decoding together through the batcher, as `prunewatch serve` runs them."""
    errors: list[BaseException] = []

    def generate(prompt: str) -> None:
        try:
            for _ in engine.stream(prompt, max_new_tokens=6, sensitivity=0.0, batcher=batcher):
                pass
        except BaseException as exc:  # re-raised below, in the fixture's thread
            errors.append(exc)

    threads = [threading.Thread(target=generate, args=(prompt,)) for prompt in SERVED_PROMPTS]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    if errors:
        raise errors[0]


def _rules_evaluated_after(base: str, moment: float) -> bool:
    groups = _get(f"{base}/api/v1/rules")["groups"]
    stamps = [datetime.fromisoformat(g["lastEvaluation"].replace("Z", "+00:00")).timestamp() for g in groups]
    return bool(stamps) and min(stamps) > moment


def _label_values_for(base: str, variable_query: str, values: dict[str, list[str]]) -> list[str]:
    """Run a `label_values(selector, label)` variable query the way Grafana does (series API)."""
    inner = variable_query.strip()[len("label_values("):-1]
    selector, label = inner.rsplit(",", 1)
    selection = Selection(values=values, constants={}, time_from=datetime.now(UTC),
                          time_to=datetime.now(UTC), interval="1s", rate_interval="1m")
    return prom_label_values(base, label.strip(), expand_promql(selector.strip(), selection))


def _test_probes() -> tuple[ProbeSet, ProbeSet]:
    """Two canonical probes (legal, tech), shortened to keep CPU time low, without and with one probe
    whose input trips the engine's anomaly fallback (it runs dense and says why)."""
    canonical = load_probes().by_domain()
    short = tuple(replace(canonical[d][0], system="", prompt=canonical[d][0].prompt[:90], max_tokens=4)
                  for d in DOMAINS)
    anomalous = Probe(id="tech-anomalous-input", domain="tech", version=1, max_tokens=2, system="",
                      prompt=ANOMALOUS_PROMPT)
    return (ProbeSet(probes=short, source="dashboards live test"),
            ProbeSet(probes=short + (anomalous,), source="dashboards live test, with an anomalous input"))


def _rule_file_with_firing_alert() -> str:
    """The committed rule file with ProbeFailing's hold time set to 0s, so it fires within the test."""
    data = yaml.safe_load(RULES_PATH.read_text())
    found = 0
    for group in data["groups"]:
        for rule in group["rules"]:
            if rule.get("alert") == FIRING_ALERT:
                rule["for"] = "0s"
                found += 1
    assert found == 1, f"{FIRING_ALERT} not found exactly once in {RULES_PATH}"
    return yaml.safe_dump(data, sort_keys=False)


@pytest.fixture(scope="module")
def live(probe_engine, postgres) -> Iterator[LiveStack]:
    database = f"dashboards_{uuid.uuid4().hex[:8]}"
    admin = create_engine(postgres.url, isolation_level="AUTOCOMMIT")
    with admin.connect() as connection:
        connection.execute(text(f'CREATE DATABASE "{database}"'))
    admin.dispose()
    db_url = make_url(postgres.url).set(database=database).render_as_string(hide_password=False)
    db = connect(db_url)
    create_schema(db)

    metrics = CollectorMetrics()
    metrics.set_thresholds(measured_range(model=probe_engine.name).thresholds())  # as `prunewatch run` exports them
    port = free_port()
    metrics_server, _ = start_http_server(port, addr="127.0.0.1", registry=metrics.registry)
    # What `prunewatch serve` exports from its batcher, fed by real requests decoding together through one: the
    # serving panels' series. Only the batcher's families (no generation is recorded as a live probe result, which
    # would add a target and a domain to the collector's series the other panels are checked against).
    batcher = probe_engine.new_batcher(len(SERVED_PROMPTS), threads=2, kv_budget_bytes=KV_BUDGET_BYTES)
    server_metrics = ServerMetrics(probe_engine.name, registry=CollectorRegistry())
    server_metrics.watch_stepper(batcher.stepper_time)
    server_metrics.watch_kv_cache(lambda: batcher.kv_reserved_bytes, KV_BUDGET_BYTES)
    engine_port = free_port()
    engine_server, _ = start_http_server(engine_port, addr="127.0.0.1", registry=server_metrics.registry)
    config = yaml.safe_dump({
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": ["rules.yml"],
        "scrape_configs": [{"job_name": "prunewatch-collector",
                            "static_configs": [{"targets": [f"127.0.0.1:{port}"]}]},
                           {"job_name": "prunewatch-engine",
                            "static_configs": [{"targets": [f"127.0.0.1:{engine_port}"]}]}],
    })
    plain, with_anomaly = _test_probes()
    # A full quality check: the reference-scored figures (primary) and the continuation ones (secondary panels).
    healthy = InProcessTarget(probe_engine, name="embedded", sensitivity=0.5, quality="full")
    # A real misconfiguration: the engine refuses a sensitivity outside [0, 1] (invalid_request).
    misconfigured = InProcessTarget(probe_engine, name="misconfigured", sensitivity=1.5)
    exporters = [metrics, SqlExporter(db)]
    # The healthy target's rounds are also judged by the quality governor (a floor it meets: it holds 0.5),
    # so the governor's gauge is exported in the same registry.
    governor = Governor({"embedded": GovernorSettings(floor=0.05)}, metrics=GovernorMetrics(metrics.registry))
    # Healthy and failing rounds alternate, each scraped before the next, so that every counter and
    # histogram increases between two samples (rate() and increase() need that). Two healthy rounds
    # are the fewest that give each domain's histograms an increase.
    # The healthy rounds also run the dense baselines (both, so the dense histograms increase too).
    schedule = [(healthy, with_anomaly), (misconfigured, plain), (healthy, plain), (misconfigured, plain),
                (misconfigured, plain)]
    started = datetime.now(UTC)
    try:
        with prometheus_server(config, {"rules.yml": _rule_file_with_firing_alert()}) as prom:
            results: list[ProbeResult] = []
            rounds = 0
            for target, probe_set in schedule:
                summary = run_round(target, probe_set, exporters, baseline=target is healthy)
                assert summary.export_errors == 0
                if target is healthy:
                    governor.observe_round(summary, 0.5)
                    _serve_together(probe_engine, batcher)
                results.extend(summary.results)
                rounds += 1
                _poll(lambda: _scraped_total(prom.url, len(results)), f"a scrape after round {rounds}")
                steps = sum(batcher.batch_sizes.values())
                _poll(lambda steps=steps: _scraped_steps(prom.url, steps),
                      f"the batcher's steps scraped after round {rounds}")
            scraped_at = time.time()
            _poll(lambda: _rules_evaluated_after(prom.url, scraped_at), "a rule evaluation after the last scrape")
            _poll(lambda: prom_query(prom.url, f'ALERTS{{alertname="{FIRING_ALERT}", alertstate="firing"}}'),
                  f"{FIRING_ALERT} firing")
            yield LiveStack(prometheus_url=prom.url, db_url=db_url, results=[r for r in results if not r.baseline],
                            baselines=[r for r in results if r.baseline], rounds=rounds,
                            started=started, model=probe_engine.name, settings=DashboardSettings(),
                            served_steps=dict(batcher.batch_sizes))
    finally:
        metrics_server.shutdown()
        engine_server.shutdown()
        batcher.close()
        db.dispose()


@pytest.fixture(scope="module")
def dashboards() -> dict[str, dict]:
    return build_dashboards()


def _prom_values(live: LiveStack, dashboard: dict) -> dict[str, list[str]]:
    """Each query variable set to "All": every value its own query lists (Grafana's default here)."""
    values: dict[str, list[str]] = {}
    for variable in template_variables(dashboard):
        listed = _label_values_for(live.prometheus_url, variable.text, values)
        assert listed, f"{variable.label} lists no values"
        values[variable.ref_id] = listed
    return values


def _sql_values(live: LiveStack, dashboard: dict) -> dict[str, list[str]]:
    values: dict[str, list[str]] = {}
    engine = create_engine(live.db_url)
    try:
        with engine.connect() as connection:
            for variable in template_variables(dashboard):
                sql = expand_sql(variable.text, live.selection(values))
                listed = [row[0] for row in connection.execute(text(sql))]
                assert listed, f"{variable.label} lists no values"
                values[variable.ref_id] = listed
    finally:
        engine.dispose()
    return values


def _finite_values(result: list[dict]) -> list[float]:
    return [float(s["value"][1]) for s in result if math.isfinite(float(s["value"][1]))]


# -- every query ---------------------------------------------------------------------------------
def test_template_variables_list_what_the_collector_recorded(live, dashboards):
    domains = sorted({r.domain for r in live.results})
    assert domains == list(DOMAINS)
    overview = _prom_values(live, dashboards["prunewatch-overview.json"])
    assert overview == {"model": [live.model], "domain": domains, "target": ["embedded", "misconfigured"]}
    history = _sql_values(live, dashboards["prunewatch-history.json"])
    assert history == {"model": [live.model], "domain": domains, "target": ["embedded", "misconfigured"]}


def test_every_promql_target_returns_finite_data(live, dashboards):
    checked, empty = 0, []
    for dashboard in dashboards.values():
        promql = [q for q in panel_queries(dashboard) if q.language == "promql"]
        if not promql:
            continue
        values = _prom_values(live, dashboard)
        for query in promql:
            result = prom_query(live.prometheus_url, expand_promql(query.text, live.selection(values)))
            checked += 1
            if not _finite_values(result):
                empty.append(f"{query.label}: {result}")
    assert not empty, "panels without data:\n" + "\n".join(empty)
    assert checked == sum(q.language == "promql" for d in dashboards.values() for q in panel_queries(d)) == 47


def test_every_sql_target_returns_rows(live, dashboards):
    engine = create_engine(live.db_url)
    checked, empty = 0, []
    try:
        with engine.connect() as connection:
            for dashboard in dashboards.values():
                sql_queries = [q for q in panel_queries(dashboard) if q.language == "sql"]
                if not sql_queries:
                    continue
                values = (_sql_values(live, dashboard) if any(v.language == "sql" for v in template_variables(dashboard))
                          else _prom_values(live, dashboard))
                for query in sql_queries:
                    rows = connection.execute(text(expand_sql(query.text, live.selection(values)))).all()
                    checked += 1
                    if not rows:
                        empty.append(query.label)
    finally:
        engine.dispose()
    assert not empty, "SQL panels without rows:\n" + "\n".join(empty)
    assert checked == 15


# -- figures against independent computation -------------------------------------------------------
def _last_ok_by_probe(results: list[ProbeResult]) -> dict[tuple[str, str], ProbeResult]:
    last: dict[tuple[str, str], ProbeResult] = {}
    for result in results:
        if result.ok:
            last[(result.domain, result.probe_id)] = result
    return last


def _query(live: LiveStack, dashboard: dict, panel: str, ref: str = "A", **pinned: list[str]) -> list[dict]:
    values = {**_prom_values(live, dashboard), **pinned}
    (query,) = [q for q in panel_queries(dashboard) if q.panel == panel and q.ref_id == ref]
    return prom_query(live.prometheus_url, expand_promql(query.text, live.selection(values)))


def test_ratio_trend_and_buckets_match_the_probe_results(live, dashboards):
    overview = dashboards["prunewatch-overview.json"]
    last = _last_ok_by_probe(live.results)
    by_domain: dict[str, list[float]] = defaultdict(list)
    for (domain, _probe), result in last.items():
        by_domain[domain].append(result.pruning_ratio)
    trend = _query(live, overview, "Pruning ratio by domain (measured)")
    assert {s["metric"]["domain"]: float(s["value"][1]) for s in trend} == pytest.approx(
        {d: float(np.mean(v)) for d, v in by_domain.items()}, abs=1e-12)

    buckets = load_rule_file().buckets
    expected = {b.label: 0 for b in buckets}
    for result in last.values():
        for bucket in buckets:
            above_low = result.pruning_ratio >= bucket.low if bucket.low_inclusive else result.pruning_ratio > bucket.low
            below_high = (result.pruning_ratio <= bucket.high if bucket.high_inclusive
                          else result.pruning_ratio < bucket.high)
            if above_low and below_high:
                expected[bucket.label] += 1
    for index, bucket in enumerate(buckets):
        (sample,) = _query(live, overview, "Probes per ratio bucket (measured, last probe)", chr(ord("A") + index))
        assert float(sample["value"][1]) == expected[bucket.label], bucket.label
    assert sum(expected.values()) == len(last) == 3


def test_cost_formulas_use_the_configured_prices(live, dashboards):
    overview = dashboards["prunewatch-overview.json"]
    settings = live.settings
    last = _last_ok_by_probe(live.results)
    domain_means = defaultdict(list)
    for (domain, _probe), result in last.items():
        domain_means[domain].append(result.pruning_ratio)
    mean_ratio = float(np.mean([np.mean(v) for v in domain_means.values()]))
    panel = "Cost savings (estimated from configured prices)"
    (saved,) = _query(live, overview, panel, "A")
    assert float(saved["value"][1]) == pytest.approx(settings.usd_per_million_tokens * mean_ratio, rel=1e-12)
    (freed,) = _query(live, overview, panel, "B")
    assert float(freed["value"][1]) == pytest.approx(settings.gpu_usd_per_hour * mean_ratio, rel=1e-12)
    # tokens/s gauge: the last successful probe of each domain (the gauge has no probe label)
    last_tps = {}
    for result in live.results:
        if result.ok:
            last_tps[result.domain] = result.tokens_per_s
    (gpu,) = _query(live, overview, panel, "C")
    assert float(gpu["value"][1]) == pytest.approx(
        settings.gpu_usd_per_hour * 1e6 / (3600 * float(np.mean(list(last_tps.values())))), rel=1e-12)


def test_alerts_panel_shows_the_probe_failing_alert_firing_per_domain(live, dashboards):
    result = _query(live, dashboards["prunewatch-overview.json"], "Alerts firing")
    firing = {(s["metric"]["alertname"], s["metric"]["domain"]) for s in result}
    assert firing >= {(FIRING_ALERT, d) for d in {r.domain for r in live.results}}


def test_failure_panels_count_the_real_failures(live, dashboards):
    failed = [r for r in live.results if not r.ok]
    assert {r.failure_reason for r in failed} == {"invalid_request"} and len(failed) == 3 * len(DOMAINS)
    result = _query(live, dashboards["prunewatch-engine.json"], "Probe failures by reason (counted)")
    assert {(s["metric"]["domain"], s["metric"]["reason"]) for s in result} == {
        (d, "invalid_request") for d in {r.domain for r in failed}}
    rate = _query(live, dashboards["prunewatch-overview.json"], "Probe failure rate (measured)")
    failing = {r.target for r in failed}
    by_target = {(s["metric"]["target"], s["metric"]["domain"]): float(s["value"][1]) for s in rate}
    assert all(0.2 < v <= 1.0 for (target, _), v in by_target.items() if target in failing)
    # A target without failures shows a measured 0, not a gap: its failure counters exist from its first result.
    assert {v for (target, _), v in by_target.items() if target not in failing} == {0.0}
    assert len(by_target) == len(DOMAINS) * len({r.target for r in live.results})


def test_dram_panel_keeps_its_source_label(live, dashboards):
    result = _query(live, dashboards["prunewatch-engine.json"], "DRAM bytes per instruction (by source)")
    sources = {r.dram_source for r in live.results if r.ok and r.dram_bytes_per_instruction is not None}
    assert {s["metric"]["source"] for s in result} == sources == {"estimate"}


def test_serving_panels_read_the_batchers_own_time_and_steps(live, dashboards):
    engine = dashboards["prunewatch-engine.json"]
    shares = _query(live, engine, "Stepper time by activity (measured share)")
    assert {s["metric"]["activity"] for s in shares} == set(STEPPER_ACTIVITIES)
    assert math.isclose(sum(float(s["value"][1]) for s in shares), 1.0, rel_tol=1e-9)
    assert all(float(s["value"][1]) > 0 for s in shares if s["metric"]["activity"] in ("decode", "jobs"))
    steps = _query(live, engine, "Decode steps per second by rows in the step (measured)")
    assert {int(s["metric"]["rows"]) for s in steps} == set(live.served_steps)
    assert max(live.served_steps) >= 2  # the requests really shared steps
    panel = "KV cache reserved by decoding requests (measured) against its budget (configured)"
    (budget,) = _query(live, engine, panel, ref="B")
    assert float(budget["value"][1]) == KV_BUDGET_BYTES
    (reserved,) = _query(live, engine, panel)
    assert float(reserved["value"][1]) == 0  # every request finished and gave its reservation back


def _sql_rows(live: LiveStack, dashboard: dict, panel: str) -> list[Any]:
    values = _sql_values(live, dashboard) if dashboard["uid"] == "prunewatch-history" else _prom_values(live, dashboard)
    (query,) = [q for q in panel_queries(dashboard) if q.panel == panel]
    engine = create_engine(live.db_url)
    try:
        with engine.connect() as connection:
            return connection.execute(text(expand_sql(query.text, live.selection(values)))).all()
    finally:
        engine.dispose()


def test_scatter_trend_is_the_least_squares_line_of_the_points(live, dashboards):
    rows = _sql_rows(live, dashboards["prunewatch-overview.json"], "Inference latency vs pruning ratio (measured, per probe)")
    ok = [r for r in live.results if r.ok]
    assert sorted((round(r[0], 9), round(r[1], 6)) for r in rows) == sorted(
        (round(r.pruning_ratio, 9), round(r.inference_ms, 6)) for r in ok)
    x = np.array([r[0] for r in rows])
    y = np.array([r[1] for r in rows])
    slope, intercept = np.polyfit(x, y, 1)
    assert [r[2] for r in rows] == pytest.approx(list(intercept + slope * x), rel=1e-9)


def test_fallback_panel_counts_the_anomalous_probe(live, dashboards):
    rows = _sql_rows(live, dashboards["prunewatch-engine.json"], "Dense fallbacks by reason (measured, from the store)")
    reasons = [r.fallback_reason for r in live.results if r.fallback_reason]
    assert reasons == ["punctuation_run"]  # the anomalous probe, run once
    totals: dict[str, int] = defaultdict(int)
    for row in rows:
        totals[row[1]] += row[2]
    assert dict(totals) == {"punctuation_run": 1}


def test_history_bucket_and_round_tables_match_the_store(live, dashboards):
    history = dashboards["prunewatch-history.json"]
    buckets = load_rule_file().buckets
    counts = dict((row[0], row[1]) for row in _sql_rows(live, history, "Probe results per ratio bucket (counted)"))
    expected: dict[str, int] = defaultdict(int)
    for result in live.results:
        if result.ok:
            label = next(b.label for b in buckets
                         if (result.pruning_ratio < b.high or (b.high_inclusive and result.pruning_ratio <= b.high)))
            expected[label] += 1
    assert counts == dict(expected)
    assert all(parse_bucket(label) in buckets for label in counts)
    rounds = _sql_rows(live, history, "Collector rounds (counted)")
    assert len(rounds) == live.rounds
    assert sorted((r[1], r[3], r[4]) for r in rounds) == sorted(
        [("embedded", 3 + 3, 0), ("embedded", 2 + 2, 0)] + [("misconfigured", 0, 2)] * 3)  # + dense baselines


def test_a_single_domain_selection_narrows_prometheus_and_sql_panels(live, dashboards):
    overview = dashboards["prunewatch-overview.json"]
    trend = _query(live, overview, "Pruning ratio by domain (measured)", domain=["legal"])
    assert {s["metric"]["domain"] for s in trend} == {"legal"}
    history = dashboards["prunewatch-history.json"]
    values = {**_sql_values(live, history), "domain": ["legal"]}
    (query,) = [q for q in panel_queries(history) if q.panel == "Recent probe results"]
    engine = create_engine(live.db_url)
    try:
        with engine.connect() as connection:
            rows = connection.execute(text(expand_sql(query.text, live.selection(values)))).mappings().all()
    finally:
        engine.dispose()
    assert {r["domain"] for r in rows} == {"legal"}
    assert len(rows) == sum(r.domain == "legal" for r in live.results + live.baselines) == 5 + 2
    assert sorted(r["run"] for r in rows) == ["dense baseline"] * 2 + ["pruned"] * 5


def test_pruned_and_dense_latency_series_come_from_their_own_runs(live, dashboards):
    """The pruned-vs-dense panel shows both configurations of the same target, each from its own runs."""
    overview = dashboards["prunewatch-overview.json"]
    panel = "Inference latency, pruned vs dense baseline (measured, p50)"
    pruned, dense = _query(live, overview, panel, "A"), _query(live, overview, panel, "B")
    assert {s["metric"]["target"] for s in pruned} == {s["metric"]["target"] for s in dense} == {"embedded"}
    assert {s["metric"]["domain"] for s in dense} == {r.domain for r in live.baselines}
    assert live.baselines and all(r.sensitivity == 0 and r.pruning_ratio == 0 for r in live.baselines)
    assert len(live.baselines) == sum(r.ok for r in live.results)  # each pruned probe had its dense twin


def test_quality_panel_shows_the_interval_and_the_models_measured_floor(live, dashboards):
    """The reference-scored agreement with its 95% interval (what QualityAgreementLow reads) and the model's
    measured floor, from the threshold series the collector exports."""
    overview = dashboards["prunewatch-overview.json"]
    panel = "Reference-scored agreement of served answers (measured, 95% interval over prompts)"
    estimate, low, high = (_query(live, overview, panel, ref) for ref in "ABC")
    by = {ref: {s["metric"]["domain"]: float(s["value"][1]) for s in series}
          for ref, series in zip("elh", (estimate, low, high))}
    assert set(by["e"]) == set(DOMAINS)
    for domain in DOMAINS:
        assert by["l"][domain] <= by["e"][domain] <= by["h"][domain]
    (floor,) = _query(live, overview, panel, "E")
    assert floor["metric"] == {"model": live.model, "kind": "quality_floor", "source": "calibration"}
    expected = {t.kind: t.value for t in measured_range(model=live.model).thresholds()}["quality_floor"]
    assert float(floor["value"][1]) == pytest.approx(expected)
