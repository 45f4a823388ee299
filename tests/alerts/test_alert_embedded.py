"""The embedded evaluator end to end over a real SQLite store and a local Slack endpoint."""

from __future__ import annotations

import json
import logging
import time
from datetime import timedelta
from pathlib import Path

import pytest
from pydantic import SecretStr

from prunewatch.alerts import (
    AlertingSettings,
    EmbeddedAlerting,
    RuleSettings,
    UnsupportedRulesError,
    render_rules,
)
from prunewatch.alerts.slack import slack_text, slack_title
from prunewatch.records.store import connect
from tests.alerts.conftest import T0, result, store_results
from tests.alerts.slack_receiver import SlackReceiver

RISK_TITLE = "[FIRING:1] PruningRatioQualityRisk (critical) on probe-llama/legal at embedded"


@pytest.fixture
def rules_path(tmp_path: Path) -> Path:
    """The production rules with the quality-risk hold shortened to 0s, so one round decides."""
    path = tmp_path / "rules.yml"
    path.write_text(render_rules(RuleSettings(quality_risk_for="0s", probe_failing_for="0s")))
    return path


def settings(rules_path: Path, tmp_path: Path, url: str | None, **overrides) -> AlertingSettings:
    values = dict(rules_path=rules_path, state_path=tmp_path / "alerts-state.json", notify_backoff_s=0.05,
                  notify_backoff_max_s=0.2, notify_attempts=3, notify_budget_s=5.0, notify_timeout_s=2.0,
                  slack_webhook_url=SecretStr(url) if url else None)
    values.update(overrides)
    return AlertingSettings(**values)


def high_ratio_round(at, ratio: float = 0.6) -> list:
    return [result(at, "legal", "legal-1", ratio=ratio), result(at, "legal", "legal-2", ratio=ratio),
            result(at, "tech", "tech-1", ratio=0.3)]


def test_firing_posts_once_then_resolved_once(store, receiver: SlackReceiver, rules_path: Path,
                                              tmp_path: Path) -> None:
    store_results(store, high_ratio_round(T0))
    alerting = EmbeddedAlerting(settings(rules_path, tmp_path, receiver.url + "/hook"), store)

    first = alerting.after_round(T0 + timedelta(seconds=1))
    assert sorted((t.kind, t.alert.label("severity")) for t in first.transitions) == [
        ("firing", "critical"), ("firing", "warning")]
    # The warning red line is muted by the critical line (alertmanager.yml's inhibit rule): one post.
    assert (first.delivered, first.undelivered, first.error) == (1, 0, None)
    post = receiver.wait_for(lambda p: True, 2)
    assert post.path == "/hook" and post.title == RISK_TITLE
    assert post.text == (
        "*Pruning ratio of probe-llama on legal above 0.45: answer quality at risk*\n"
        "Pruning ratio is 0.600 (measured by the engine, each probe's last result averaged over the domain), above "
        "the quality-risk line 0.45, for 0s: check the reference-scored agreement of this domain "
        "(QualityAgreementLow). 0.45 is a fallback (the rule settings' default, not measured on this model): "
        "probe-llama has no measured thresholds; `prunewatch run` measures them at calibration, `prunewatch tune` "
        "by a sweep.\n"
        "Runbook: Run `prunewatch doctor --config <targets file> --target embedded` on the collector host (plain "
        "`prunewatch doctor` for the main job's target, embedded; an alert without a target label is about an "
        "engine's own live traffic), then lower the pruning sensitivity for this "
        "domain and check the reference-scored agreement.\n")
    assert post.body["attachments"][0]["color"] == "danger"

    again = alerting.after_round(T0 + timedelta(seconds=30))
    assert (again.transitions, again.delivered) == ([], 0)
    assert len(receiver.snapshot()) == 1  # still firing: nothing posted twice

    store_results(store, [result(T0 + timedelta(seconds=60), "legal", p, ratio=0.3) for p in ("legal-1", "legal-2")])
    resolved = alerting.after_round(T0 + timedelta(seconds=61))
    assert sorted((t.kind, t.alert.label("severity")) for t in resolved.transitions) == [
        ("resolved", "critical"), ("resolved", "warning")]
    assert resolved.delivered == 1  # the muted warning never fired in Slack, so it does not resolve there
    posts = receiver.snapshot()
    assert [p.title for p in posts] == [RISK_TITLE,
                                        "[RESOLVED] PruningRatioQualityRisk (critical) on probe-llama/legal at embedded"]
    assert posts[1].body["attachments"][0]["color"] == "good"


def test_slack_errors_are_retried_with_backoff_within_the_round(store, receiver: SlackReceiver, rules_path: Path,
                                                                 tmp_path: Path) -> None:
    store_results(store, high_ratio_round(T0))
    receiver.fail_next(2)
    alerting = EmbeddedAlerting(settings(rules_path, tmp_path, receiver.url), store)
    report = alerting.after_round(T0 + timedelta(seconds=1))
    assert (report.delivered, report.undelivered) == (1, 0)
    posts = receiver.snapshot()
    assert [p.status for p in posts] == [500, 500, 200]
    assert all(p.body == posts[0].body for p in posts)  # the same message, not three
    assert posts[1].at - posts[0].at >= 0.05 and posts[2].at - posts[1].at >= 0.1  # doubling backoff


def test_slack_down_for_a_while_message_arrives_after_it_comes_back(store, rules_path: Path,
                                                                     tmp_path: Path) -> None:
    receiver = SlackReceiver()  # not started: connection refused
    store_results(store, high_ratio_round(T0))
    alerting = EmbeddedAlerting(settings(rules_path, tmp_path, receiver.url, notify_attempts=2), store)
    down = alerting.after_round(T0 + timedelta(seconds=1))
    assert (down.delivered, down.undelivered, len(down.transitions)) == (0, 1, 2)
    receiver.start()
    try:
        back = alerting.after_round(T0 + timedelta(seconds=31))
        assert (back.transitions, back.delivered, back.undelivered) == ([], 1, 0)
        assert [p.title for p in receiver.snapshot()] == [RISK_TITLE]
        later = alerting.after_round(T0 + timedelta(seconds=61))
        assert later.delivered == 0 and len(receiver.snapshot()) == 1
    finally:
        receiver.stop()


def test_slack_client_errors_are_not_retried(store, receiver: SlackReceiver, rules_path: Path, tmp_path: Path,
                                             caplog: pytest.LogCaptureFixture) -> None:
    store_results(store, high_ratio_round(T0))
    receiver.fail_next(5, status=404)
    alerting = EmbeddedAlerting(settings(rules_path, tmp_path, receiver.url), store)
    with caplog.at_level(logging.ERROR, logger="prunewatch.alerts"):
        report = alerting.after_round(T0 + timedelta(seconds=1))
    assert (report.delivered, report.undelivered) == (0, 0)
    assert [p.status for p in receiver.snapshot()] == [404]
    assert "HTTP 404: no_service" in caplog.text and "not retried" in caplog.text


def test_rate_limit_waits_for_retry_after_capped(store, receiver: SlackReceiver, rules_path: Path,
                                                 tmp_path: Path) -> None:
    store_results(store, high_ratio_round(T0))
    receiver.fail_next(1, status=429, retry_after="30")
    alerting = EmbeddedAlerting(settings(rules_path, tmp_path, receiver.url, notify_backoff_max_s=0.3), store)
    report = alerting.after_round(T0 + timedelta(seconds=1))
    posts = receiver.snapshot()
    assert report.delivered == 1 and [p.status for p in posts] == [429, 200]
    assert 0.3 <= posts[1].at - posts[0].at < 5  # Retry-After honoured, but never beyond the configured cap


def test_restart_with_state_file_never_reposts_a_firing(store, receiver: SlackReceiver, rules_path: Path,
                                                        tmp_path: Path) -> None:
    store_results(store, high_ratio_round(T0))
    config = settings(rules_path, tmp_path, receiver.url)
    EmbeddedAlerting(config, store).after_round(T0 + timedelta(seconds=1))
    assert len(receiver.snapshot()) == 1
    state = json.loads(config.state_path.read_text())
    assert {(a["rule"], a["state"]) for a in state["evaluator"]["alerts"]} == {
        ("PruningRatioQualityRisk", "firing"), ("PruningRatioLow", "pending")}  # tech's 0.3 waits out its 2h

    restarted = EmbeddedAlerting(config, store)  # a new process over the same store and state file
    store_results(store, high_ratio_round(T0 + timedelta(minutes=10)))
    report = restarted.after_round(T0 + timedelta(minutes=10, seconds=1))
    assert (report.transitions, report.delivered) == ([], 0)
    assert len(receiver.snapshot()) == 1


def test_unconfigured_slack_evaluates_and_logs_only(store, rules_path: Path, tmp_path: Path,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    store_results(store, high_ratio_round(T0))
    with caplog.at_level(logging.WARNING, logger="prunewatch.alerts"):
        alerting = EmbeddedAlerting(settings(rules_path, tmp_path, None), store)
        report = alerting.after_round(T0 + timedelta(seconds=1))
    assert "Slack is not configured" in caplog.text
    assert ("alert firing: PruningRatioQualityRisk{domain=legal, model=probe-llama, severity=critical, source=fallback, "
            "target=embedded}"
            in caplog.text)
    assert len(report.transitions) == 2 and alerting.outbox == []


def test_webhook_url_is_read_from_the_secret_file(store, receiver: SlackReceiver, rules_path: Path,
                                                  tmp_path: Path) -> None:
    secret = tmp_path / "slack-url"
    secret.write_text(receiver.url + "/from-file\n")
    store_results(store, high_ratio_round(T0))
    alerting = EmbeddedAlerting(settings(rules_path, tmp_path, None, slack_webhook_url_file=secret), store)
    assert alerting.after_round(T0 + timedelta(seconds=1)).delivered == 1
    assert receiver.snapshot()[0].path == "/from-file"
    assert "from-file" not in repr(settings(rules_path, tmp_path, receiver.url + "/from-file"))  # masked


def test_probe_failing_mutes_quality_risk_as_alertmanager_does(store, receiver: SlackReceiver, rules_path: Path,
                                                               tmp_path: Path) -> None:
    at = T0
    rows = high_ratio_round(at)
    rows += [result(at + timedelta(seconds=s), "legal", f"legal-{i}", status="failed", reason="timeout")
             for s in range(1, 4) for i in (1, 2)]
    store_results(store, rows)
    alerting = EmbeddedAlerting(settings(rules_path, tmp_path, receiver.url), store)
    report = alerting.after_round(at + timedelta(seconds=5))
    fired = sorted((t.alert.rule, t.alert.label("severity")) for t in report.transitions)
    assert fired == [("ProbeFailing", "critical"), ("PruningRatioQualityRisk", "critical"),
                     ("PruningRatioQualityRisk", "warning")]
    assert [p.title for p in receiver.snapshot()] == ["[FIRING:1] ProbeFailing (critical) on probe-llama/legal at embedded"]
    assert "0.75 of probe results failed" in receiver.snapshot()[0].text  # 6 failed of 8 results

    later = at + timedelta(minutes=16)  # the failures leave the 15m window; the ratio stays high
    store_results(store, high_ratio_round(later))
    report = alerting.after_round(later + timedelta(seconds=1))
    assert [(t.kind, t.alert.rule) for t in report.transitions] == [("resolved", "ProbeFailing")]
    assert [p.title for p in receiver.snapshot()][1:] == [
        "[RESOLVED] ProbeFailing (critical) on probe-llama/legal at embedded", RISK_TITLE]  # no longer muted: posted now


def test_after_round_never_raises_when_the_store_is_gone(rules_path: Path, tmp_path: Path) -> None:
    broken = connect(f"sqlite:///{tmp_path / 'missing' / 'store.db'}", check=False)
    alerting = EmbeddedAlerting(settings(rules_path, tmp_path, None), broken)
    report = alerting.after_round(T0)
    assert report.error is not None and "OperationalError" in report.error


def test_unsupported_rules_are_reported_and_strict_refuses(store, tmp_path: Path,
                                                           caplog: pytest.LogCaptureFixture) -> None:
    rules = tmp_path / "rules.yml"
    rules.write_text(render_rules(RuleSettings()) + (
        "- name: extra\n  rules:\n"
        "  - alert: TopLatency\n    expr: topk(3, prunewatch_tokens_per_second) > 0\n"
        "  - alert: BadTemplate\n    expr: prunewatch_tokens_per_second > 0\n"
        "    annotations:\n      summary: '{{ $value | humanize }}'\n"))
    with caplog.at_level(logging.WARNING, logger="prunewatch.alerts"):
        alerting = EmbeddedAlerting(settings(rules, tmp_path, None), store)
    reasons = {rule.name: rule.reason for rule in alerting.unsupported}
    assert set(reasons) == {"CollectorBufferBacklog", "TopLatency", "BadTemplate"}
    assert "aggregation 'topk'" in reasons["TopLatency"]
    assert "template function 'humanize' is not supported" in reasons["BadTemplate"]
    assert "metric prunewatch_collector_buffer_depth is not derived from stored probe results" in \
        reasons["CollectorBufferBacklog"]
    assert "extra/TopLatency is not evaluated without Prometheus" in caplog.text
    with pytest.raises(UnsupportedRulesError, match="TopLatency"):
        EmbeddedAlerting(settings(rules, tmp_path, None, strict=True), store)


def test_evaluation_time_must_be_timezone_aware(store, rules_path: Path, tmp_path: Path) -> None:
    alerting = EmbeddedAlerting(settings(rules_path, tmp_path, None), store)
    with pytest.raises(ValueError, match="timezone-aware"):
        alerting.evaluate(T0.replace(tzinfo=None))


def test_message_format_matches_alertmanager_template_for_one_alert() -> None:
    labels = {"alertname": "ProbeDataAbsent", "severity": "critical"}
    assert slack_title("firing", labels) == "[FIRING:1] ProbeDataAbsent (critical)"
    assert slack_title("resolved", {**labels, "model": "m", "domain": "d"}) == \
        "[RESOLVED] ProbeDataAbsent (critical) on m/d"
    assert slack_text({"summary": "S", "description": "D", "runbook": "R"}) == "*S*\nD\nRunbook: R\n"


def test_delivery_stays_within_the_round_budget(store, rules_path: Path, tmp_path: Path) -> None:
    receiver = SlackReceiver()  # down for the whole round
    store_results(store, high_ratio_round(T0))
    alerting = EmbeddedAlerting(settings(rules_path, tmp_path, receiver.url, notify_attempts=10,
                                         notify_backoff_s=0.2, notify_backoff_max_s=0.2, notify_budget_s=1.0), store)
    began = time.monotonic()
    report = alerting.after_round(T0 + timedelta(seconds=1))
    assert time.monotonic() - began < 3.0
    assert report.undelivered == 1 and alerting.outbox[0].attempts >= 3
