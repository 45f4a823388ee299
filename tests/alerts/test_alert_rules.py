"""rules.yml is rendered from the PromQL constants and RuleSettings, and the committed file is that rendering."""

from __future__ import annotations

import os
import re

import pytest
import yaml
from promql_parser import BinaryExpr, ParenExpr
from pydantic import ValidationError

from prunewatch.alerts import RULES_PATH, RuleSettings, render_rules
from prunewatch.alerts._parser import parse
from prunewatch.alerts.rules import compare
from prunewatch.records.promql import (
    PROMQL_AGREEMENT_AVG_1H,
    PROMQL_AGREEMENT_BY_DOMAIN,
    PROMQL_BUFFER_DEPTH,
    PROMQL_FAILURE_RATE,
    PROMQL_LATENCY_P99,
    PROMQL_RATIO_AVG_24H,
    PROMQL_RATIO_BY_DOMAIN,
    promql_governor_clamps,
)

ALERT_SOURCES = {
    "PruningRatioLow": (PROMQL_RATIO_AVG_24H, "<"),
    "PruningRatioQualityRisk": (PROMQL_RATIO_BY_DOMAIN, ">"),
    "QualityAgreementLow": (PROMQL_AGREEMENT_AVG_1H, "<"),
    "LatencySLOBreached": (PROMQL_LATENCY_P99, ">"),
    "ProbeFailing": (PROMQL_FAILURE_RATE, ">"),
    "CollectorBufferBacklog": (PROMQL_BUFFER_DEPTH, ">"),
    "PruningGovernorClamped": (promql_governor_clamps("15m"), ">"),
}


@pytest.fixture
def defaults(monkeypatch: pytest.MonkeyPatch) -> RuleSettings:
    for name in list(os.environ):
        if name.startswith("PRUNEWATCH_RULE_"):
            monkeypatch.delenv(name)
    return RuleSettings()


def alert_rules(text: str) -> list[dict]:
    return [r for g in yaml.safe_load(text)["groups"] for r in g["rules"] if "alert" in r]


def test_committed_rules_equal_the_rendering_of_the_defaults(defaults: RuleSettings) -> None:
    assert RULES_PATH.read_text() == render_rules(defaults), \
        "prunewatch/alerts/rules.yml is stale: run `prunewatch alerts render-rules --out prunewatch/alerts/rules.yml`"


def test_alerts_compare_the_promql_constants_verbatim(defaults: RuleSettings) -> None:
    rules = alert_rules(render_rules(defaults))
    thresholds = {("PruningRatioQualityRisk", "warning"): 0.44, ("PruningRatioQualityRisk", "critical"): 0.45,
                  ("PruningRatioLow", "warning"): 0.35, ("QualityAgreementLow", "warning"): 0.8,
                  ("LatencySLOBreached", "critical"): 1.3, ("ProbeFailing", "critical"): 0.2,
                  ("CollectorBufferBacklog", "warning"): 100, ("PruningGovernorClamped", "warning"): 0}
    seen = set()
    for rule in rules:
        key = (rule["alert"], rule["labels"]["severity"])
        if rule["alert"] == "ProbeDataAbsent":
            assert rule["expr"] == "absent_over_time(prunewatch_probe_results_total[10m])" and "for" not in rule
            continue
        source, op = ALERT_SOURCES[rule["alert"]]
        node = parse(rule["expr"])
        assert isinstance(node, BinaryExpr) and str(node.op) == op
        left = node.lhs.expr if isinstance(node.lhs, ParenExpr) else node.lhs
        assert left.prettify() == parse(source).prettify()  # the constant itself, not a look-alike
        assert source in rule["expr"]
        assert node.rhs.val == thresholds[key]
        seen.add(key)
    assert seen == set(thresholds)


def test_recording_rules_are_the_constants_under_stable_names(defaults: RuleSettings) -> None:
    groups = yaml.safe_load(render_rules(defaults))["groups"]
    records = [(r["record"], r["expr"], r.get("labels")) for g in groups for r in g["rules"] if "record" in r]
    by_name = {name: expr for name, expr, labels in records if labels is None}
    assert by_name == {
        "prunewatch:pruning_ratio_avg:24h": PROMQL_RATIO_AVG_24H,
        "prunewatch:pruning_ratio_avg:last": PROMQL_RATIO_BY_DOMAIN,
        "prunewatch:inference_latency_p99:5m": PROMQL_LATENCY_P99,
        "prunewatch:probe_failure_rate:15m": PROMQL_FAILURE_RATE,
        "prunewatch:continuation_agreement_avg:1h": PROMQL_AGREEMENT_AVG_1H,
        "prunewatch:continuation_agreement_avg:last": PROMQL_AGREEMENT_BY_DOMAIN,
    }
    buckets = [(labels["bucket"], expr) for name, expr, labels in records if labels is not None]
    assert buckets == [
        ("[0,0.35)", "count by (target, model, domain) (prunewatch_pruning_ratio >= 0 < 0.35)"),
        ("[0.35,0.42)", "count by (target, model, domain) (prunewatch_pruning_ratio >= 0.35 < 0.42)"),
        ("[0.42,0.47]", "count by (target, model, domain) (prunewatch_pruning_ratio >= 0.42 <= 0.47)"),
        ("(0.47,1]", "count by (target, model, domain) (prunewatch_pruning_ratio > 0.47)"),
    ]
    assert all(re.fullmatch(r"prunewatch:[a-z0-9_]+:(\d+[smhd]|last)", name) for name, _, _ in records)


def test_thresholds_and_holds_come_from_the_settings(defaults: RuleSettings) -> None:
    custom = RuleSettings(quality_red_line=0.42, quality_risk_ratio=0.5, latency_slo_s=2.5, ratio_low_for="3h",
                          absent_for="20m", ratio_buckets=(0.3, 0.4, 0.5))
    rules = {(r["alert"], r["labels"]["severity"]): r for r in alert_rules(render_rules(custom))}
    assert rules[("PruningRatioQualityRisk", "warning")]["expr"].endswith("> 0.42")
    assert rules[("PruningRatioQualityRisk", "critical")]["expr"].endswith("> 0.5")
    assert "above the configured red line 0.42" in rules[("PruningRatioQualityRisk", "warning")]["annotations"][
        "description"]
    # Where each unmeasured threshold came from: this deployment's setting, or the shipped default.
    origin = {key: rule["annotations"]["description"] for key, rule in rules.items()}
    assert "0.42 was set in this deployment's rule settings, not measured" in origin[("PruningRatioQualityRisk", "warning")]
    assert "(0.5 was set in this deployment's rule settings, not measured" in origin[("PruningRatioQualityRisk", "critical")]
    assert "0.35 is a configured default, not measured" in origin[("PruningRatioLow", "warning")]
    assert "configured default" not in origin[("PruningRatioQualityRisk", "warning")]
    assert rules[("LatencySLOBreached", "critical")]["expr"].endswith("> 2.5")
    assert rules[("PruningRatioLow", "warning")]["for"] == "3h"
    assert rules[("ProbeDataAbsent", "critical")]["expr"] == "absent_over_time(prunewatch_probe_results_total[20m])"
    assert "prunewatch_pruning_ratio >= 0.4 <= 0.5" in render_rules(custom)


def test_environment_overrides_a_threshold(monkeypatch: pytest.MonkeyPatch, defaults: RuleSettings) -> None:
    monkeypatch.setenv("PRUNEWATCH_RULE_LATENCY_SLO_S", "2")
    monkeypatch.setenv("PRUNEWATCH_RULE_LATENCY_SLO_FOR", "5m")
    settings = RuleSettings()
    assert settings.latency_slo_s == 2.0 and settings.latency_slo_for.total_seconds() == 300


@pytest.mark.parametrize("overrides, message", [
    ({"ratio_low": 0.5}, "ratio_low < quality_red_line <= quality_risk_ratio"),
    ({"quality_red_line": 0.46}, "ratio_low < quality_red_line <= quality_risk_ratio"),
    ({"ratio_buckets": (0.4, 0.3, 0.5)}, "ratio_buckets must be increasing"),
    ({"latency_slo_for": "ten minutes"}, "not a Prometheus duration"),
    ({"latency_slo_s": 0}, "greater than 0"),
    ({"absent_for": "0s"}, "absent_for must be positive"),
])
def test_bad_settings_are_refused_with_a_reason(overrides: dict, message: str) -> None:
    with pytest.raises(ValidationError, match=re.escape(message)):
        RuleSettings(**overrides)


def test_compare_parenthesises_binary_expressions() -> None:
    assert compare(PROMQL_FAILURE_RATE, ">", 0.2) == f"({PROMQL_FAILURE_RATE}) > 0.2"
    assert compare(PROMQL_LATENCY_P99, ">", 1.3) == f"{PROMQL_LATENCY_P99} > 1.3"
