"""Real Prometheus + Alertmanager + a local Slack endpoint, fed by real collector results.

Prometheus scrapes a CollectorMetrics registry served on 127.0.0.1 into which the results of a real
two-round collector run (`collected_sqlite`) are replayed; the rules are the production rules with
only the quality-risk hold shortened; Alertmanager runs the production config with short group
timers and its webhook URL files pointing at the local receiver.
"""

from __future__ import annotations

import dataclasses
import json
import time
import urllib.parse
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import yaml
from prometheus_client import CollectorRegistry, start_http_server
from sqlalchemy.orm import Session

from prunewatch.alerts import RuleSettings, render_rules
from prunewatch.alerts.settings import ALERTMANAGER_PATH
from prunewatch.alerts.slack import slack_text, slack_title
from prunewatch.records.metrics import CollectorMetrics
from prunewatch.records.results import ProbeResult
from prunewatch.records.store import ResultRepository, connect
from tests.alerts.conftest import measured_range
from tests.alerts.slack_receiver import SlackReceiver
from tests.support.servers import (
    ProcessServer,
    alertmanager_server,
    free_port,
    prometheus_server,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow]

DEADLINE_S = 30.0


@dataclass
class Stack:
    metrics: CollectorMetrics
    results: list[ProbeResult]
    receiver: SlackReceiver
    prometheus: ProcessServer
    alertmanager: ProcessServer

    @property
    def model(self) -> str:
        return self.results[0].model

    def record(self, domain: str, ratio: float | None = None) -> None:
        """Record the domain's real results again (now), with the pruning ratio replaced when given."""
        for real in (r for r in self.results if r.domain == domain):
            changes: dict[str, Any] = {"created_at": datetime.now(UTC), "result_id": uuid.uuid4().hex}
            if ratio is not None:
                changes["pruning_ratio"] = ratio
            self.metrics.record(dataclasses.replace(real, **changes))

    def prometheus_alerts(self) -> list[dict]:
        return get_json(f"{self.prometheus.url}/api/v1/alerts")["data"]["alerts"]


def get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=5) as response:
        return json.load(response)


def poll(what: str, check: Callable[[], Any], timeout_s: float = DEADLINE_S) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.1)
    raise TimeoutError(f"{what} within {timeout_s}s")


def alertmanager_config(receiver: SlackReceiver) -> tuple[str, dict[str, str]]:
    """The committed config with second-scale group timers and webhook files pointing at the receiver."""
    config = yaml.safe_load(ALERTMANAGER_PATH.read_text())
    config["route"].update(group_wait="1s", group_interval="1s", repeat_interval="1h")
    files = {}
    for entry in config["receivers"]:
        for slack in entry["slack_configs"]:
            name = slack["api_url_file"].rsplit("/", 1)[-1]
            slack["api_url_file"] = name  # relative: Alertmanager runs in the folder the files are written to
            files[name] = f"{receiver.url}/{entry['name']}\n"
    return yaml.safe_dump(config, sort_keys=False), files


@pytest.fixture(scope="module")
def stack(collected_sqlite: str) -> Iterator[Stack]:
    engine = connect(collected_sqlite)
    with Session(engine) as session:
        results = ResultRepository(session).list()
    engine.dispose()
    ratios = [r.pruning_ratio for r in results if r.pruning_ratio is not None]
    assert ratios and max(ratios) < 0.44, f"the probe model's measured ratios {ratios} must sit below the red line"

    metrics = CollectorMetrics(registry=CollectorRegistry())
    for r in results:
        metrics.record(r)
    port = free_port()
    http, _thread = start_http_server(port, addr="127.0.0.1", registry=metrics.registry)
    receiver = SlackReceiver().start()
    rules = render_rules(RuleSettings(quality_risk_for="2s"))
    am_yaml, am_files = alertmanager_config(receiver)
    try:
        with alertmanager_server(am_yaml, am_files) as alertmanager:
            prom_yaml = yaml.safe_dump({
                "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
                "rule_files": ["rules.yml"],
                "scrape_configs": [{"job_name": "prunewatch", "static_configs": [{"targets": [f"127.0.0.1:{port}"]}]}],
                "alerting": {"alertmanagers": [{"static_configs": [
                    {"targets": [alertmanager.url.removeprefix("http://")]}]}]},
            })
            with prometheus_server(prom_yaml, {"rules.yml": rules}) as prometheus:
                yield Stack(metrics, results, receiver, prometheus, alertmanager)
    finally:
        receiver.stop()
        http.shutdown()


def title(stack: Stack, status: str, severity: str, domain: str, alertname: str = "PruningRatioQualityRisk") -> str:
    return slack_title(status, {"alertname": alertname, "severity": severity, "model": stack.model, "domain": domain,
                                "target": stack.results[0].target})


def test_quality_risk_reaches_slack_firing_then_resolved(stack: Stack) -> None:
    firing = title(stack, "firing", "critical", "legal")
    stack.record("legal", ratio=0.6)
    post = stack.receiver.wait_for(lambda p: p.title == firing, DEADLINE_S)
    assert post.path == "/slack-critical"
    alert = next(a for a in stack.prometheus_alerts() if a["labels"].get("domain") == "legal"
                 and a["labels"]["severity"] == "critical")
    # Alertmanager's templates and the embedded evaluator's formatter write the same message.
    assert post.title == slack_title("firing", alert["labels"]) and post.text == slack_text(alert["annotations"])
    assert "Pruning ratio is 0.600 (measured by the engine" in post.text
    assert f"Runbook: Run `prunewatch doctor --config <targets file> --target {stack.results[0].target}`" in post.text

    stack.record("legal")  # the real results again: ratio back under the red line
    resolved = stack.receiver.wait_for(lambda p: p.title == title(stack, "resolved", "critical", "legal"), DEADLINE_S)
    assert resolved.path == "/slack-critical" and resolved.at > post.at
    assert resolved.body["attachments"][0]["color"] == "good"
    warnings = [p for p in stack.receiver.snapshot() if "(warning) on" in p.title and "/legal" in p.title]
    assert warnings == []  # the red-line warning was inhibited by the critical alert


def test_alertmanager_retries_until_slack_is_back(stack: Stack) -> None:
    firing = title(stack, "firing", "critical", "tech")
    stack.receiver.stop()  # Slack unreachable
    try:
        stack.record("tech", ratio=0.6)
        poll("Alertmanager receiving the tech alert", lambda: get_json(
            f"{stack.alertmanager.url}/api/v2/alerts?" + urllib.parse.urlencode({"filter": 'domain="tech"'})))
        poll("a failed Slack notification", lambda: failed_notifications(stack) >= 1)
    finally:
        # Back, but the first post of this alert still fails with a 500.
        stack.receiver.fail_next(1, matching=lambda body: body.get("attachments", [{}])[0].get("title") == firing)
        stack.receiver.start()
    post = stack.receiver.wait_for(lambda p: p.title == firing, DEADLINE_S)
    tech_posts = [p for p in stack.receiver.snapshot() if p.title == firing]
    assert [p.status for p in tech_posts][:2] == [500, 200] and post is tech_posts[1]
    stack.record("tech")


def test_one_rules_file_holds_a_second_model_to_its_own_measured_lines(stack: Stack) -> None:
    """The same rendered rules, a second model with a measured range: Prometheus fires on its own red and risk
    lines (0.3 x 1.5 and x 2: 0.45, 0.6) with their source, below which the fallback (0.44) would have fired;
    the Slack message quotes the measured line and how it was obtained."""
    measured = measured_range(model="second-model", ratio=0.25, ratio_max=0.3)
    stack.metrics.set_thresholds(measured.thresholds())
    second = [dataclasses.replace(r, model="second-model", created_at=datetime.now(UTC), result_id=uuid.uuid4().hex,
                                  pruning_ratio=0.5) for r in stack.results if r.domain == "legal" and not r.baseline]
    for r in second:  # 0.5: above the 0.44 fallback red line and the 0.45 fallback risk line, under its own 0.6
        stack.metrics.record(r)
    firing = slack_title("firing", {"alertname": "PruningRatioQualityRisk", "severity": "warning",
                                    "model": "second-model", "domain": "legal", "target": second[0].target})
    post = stack.receiver.wait_for(lambda p: p.title == firing, DEADLINE_S)
    assert post.path == "/slack-warning"
    assert "above the red line 0.450, measured for second-model (calibration;" in post.text
    alerts = [a for a in stack.prometheus_alerts() if a["labels"].get("model") == "second-model"]
    assert {(a["labels"]["severity"], a["labels"]["source"]) for a in alerts} == {("warning", "calibration")}
    for r in second:
        stack.metrics.record(dataclasses.replace(r, created_at=datetime.now(UTC), result_id=uuid.uuid4().hex,
                                                 pruning_ratio=0.2))


def failed_notifications(stack: Stack) -> float:
    with urllib.request.urlopen(f"{stack.alertmanager.url}/metrics", timeout=5) as response:
        for line in response.read().decode().splitlines():
            if line.startswith("alertmanager_notifications_failed_total") and 'integration="slack"' in line:
                return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_probe_failing_inhibits_quality_risk_in_alertmanager(stack: Stack) -> None:
    now = datetime.now(UTC)
    common = {"model": stack.model, "domain": "finance", "severity": "critical", "target": stack.results[0].target}
    alerts = [{"labels": {**common, "alertname": name}, "annotations": {"summary": name, "description": "d",
                                                                          "runbook": "r"},
               "startsAt": now.isoformat(), "endsAt": (now + timedelta(minutes=5)).isoformat()}
              for name in ("ProbeFailing", "PruningRatioQualityRisk")]
    request = urllib.request.Request(f"{stack.alertmanager.url}/api/v2/alerts", data=json.dumps(alerts).encode(),
                                     headers={"Content-Type": "application/json"}, method="POST")
    urllib.request.urlopen(request, timeout=5).close()
    stack.receiver.wait_for(lambda p: p.title == title(stack, "firing", "critical", "finance", "ProbeFailing"),
                            DEADLINE_S)
    query = urllib.parse.urlencode({"filter": ['alertname="PruningRatioQualityRisk"', 'domain="finance"']}, doseq=True)
    status = poll("the quality-risk alert marked inhibited", lambda: [
        a["status"] for a in get_json(f"{stack.alertmanager.url}/api/v2/alerts?{query}")
        if a["status"]["inhibitedBy"]])
    assert status[0]["state"] == "suppressed"
    assert not [p for p in stack.receiver.snapshot() if "PruningRatioQualityRisk" in p.title and "finance" in p.title]
