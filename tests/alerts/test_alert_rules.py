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
from prunewatch.alerts.rules import compare, compare_fallback, compare_measured
from prunewatch.records.promql import (
    PROMQL_BUFFER_DEPTH,
    PROMQL_DECODE_VS_DENSE_LOW,
    PROMQL_FAILURE_RATE,
    PROMQL_FIRST_TOKEN_VS_DENSE_LOW,
    PROMQL_LATENCY_P99,
    PROMQL_PASS_RATE,
    PROMQL_QUALITY_ESTIMATE,
    PROMQL_QUALITY_HIGH,
    PROMQL_QUALITY_LOW,
    PROMQL_QUALITY_PROMPTS,
    PROMQL_RATIO_AVG_24H,
    PROMQL_RATIO_BY_DOMAIN,
    PROMQL_REFERENCE_AGREEMENT_AVG_1H,
    PROMQL_REFERENCE_AGREEMENT_BY_DOMAIN,
    PROMQL_TPOT_15M,
    PROMQL_TPOT_VS_DENSE,
    PROMQL_TTFT_VS_DENSE,
    promql_governor_clamps,
    promql_threshold,
)

MEASURED = {  # alert, severity -> the figure, its comparison, the kind of threshold it is held against, the fallback
    ("PruningRatioLow", "warning"): (PROMQL_RATIO_AVG_24H, "<", "ratio_low", 0.35),
    ("PruningRatioQualityRisk", "warning"): (PROMQL_RATIO_BY_DOMAIN, ">", "ratio_red_line", 0.44),
    ("PruningRatioQualityRisk", "critical"): (PROMQL_RATIO_BY_DOMAIN, ">", "ratio_risk", 0.45),
    ("QualityAgreementLow", "warning"): (PROMQL_QUALITY_HIGH, "<", "quality_floor", 0.8),
    ("DecodeSlowerThanDense", "warning"): (PROMQL_DECODE_VS_DENSE_LOW, ">", "tpot_vs_dense_max", 1.5),
    ("FirstTokenSlowerThanDense", "warning"): (PROMQL_FIRST_TOKEN_VS_DENSE_LOW, ">", "ttft_vs_dense_max", 1.5),
}
CONFIGURED = {  # alert -> the figure and comparison of rules with one configured threshold
    "ProbeFailing": (PROMQL_FAILURE_RATE, ">", 0.2),
    "CollectorBufferBacklog": (PROMQL_BUFFER_DEPTH, ">", 100),
    "PruningGovernorClamped": (promql_governor_clamps("15m"), ">", 0),
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


def _strip(node):
    return node.expr if isinstance(node, ParenExpr) else node


def test_alerts_compare_the_promql_constants_verbatim(defaults: RuleSettings) -> None:
    """Each ratio, quality and latency alert twice: against the model's measured threshold `on(model)`, carrying
    its source; and against the fallback `unless` the model has a measured threshold, labelled source=fallback."""
    seen = []
    for rule in alert_rules(render_rules(defaults)):
        key = (rule["alert"], rule["labels"]["severity"])
        node = parse(rule["expr"])
        if rule["alert"] == "ProbeDataAbsent":
            assert rule["expr"] == "absent_over_time(prunewatch_probe_results_total[10m])" and "for" not in rule
            continue
        if rule["alert"] in CONFIGURED:
            source, op, value = CONFIGURED[rule["alert"]]
            assert isinstance(node, BinaryExpr) and str(node.op) == op and node.rhs.val == value
            assert _strip(node.lhs).prettify() == parse(source).prettify()
            continue
        source, op, kind, fallback = MEASURED[key]
        assert isinstance(node, BinaryExpr)
        if rule["labels"].get("source") == "fallback":
            assert str(node.op) == "unless" and node.modifier.matching.labels == ["model"]
            assert node.rhs.prettify() == parse(f'prunewatch_alert_threshold{{kind="{kind}"}}').prettify()
            inner = _strip(node.lhs)
            assert str(inner.op) == op and inner.rhs.val == fallback
            assert _strip(inner.lhs).prettify() == parse(source).prettify()
            seen.append((key, "fallback"))
        else:
            assert "source" not in rule["labels"]  # it comes from the threshold series
            assert str(node.op) == op and node.modifier.matching.labels == ["model"]
            assert node.modifier.group_labels == ["source"]
            assert _strip(node.lhs).prettify() == parse(source).prettify()  # the constant itself, not a look-alike
            assert node.rhs.prettify() == parse(promql_threshold(kind)).prettify()
            seen.append((key, "measured"))
    assert sorted(seen) == sorted((key, variant) for key in MEASURED for variant in ("measured", "fallback"))


def test_recording_rules_are_the_constants_under_stable_names(defaults: RuleSettings) -> None:
    groups = yaml.safe_load(render_rules(defaults))["groups"]
    records = [(r["record"], r["expr"], r.get("labels")) for g in groups for r in g["rules"] if "record" in r]
    by_name = {name: expr for name, expr, labels in records if labels is None}
    assert by_name == {
        "prunewatch:pruning_ratio_avg:24h": PROMQL_RATIO_AVG_24H,
        "prunewatch:pruning_ratio_avg:last": PROMQL_RATIO_BY_DOMAIN,
        "prunewatch:inference_latency_p99:5m": PROMQL_LATENCY_P99,
        "prunewatch:probe_failure_rate:15m": PROMQL_FAILURE_RATE,
        "prunewatch:reference_agreement_estimate:window": PROMQL_QUALITY_ESTIMATE,
        "prunewatch:reference_agreement_low:window": PROMQL_QUALITY_LOW,
        "prunewatch:reference_agreement_high:window": PROMQL_QUALITY_HIGH,
        "prunewatch:reference_agreement_prompts:window": PROMQL_QUALITY_PROMPTS,
        "prunewatch:task_pass_rate:window": PROMQL_PASS_RATE,
        "prunewatch:reference_agreement_avg:1h": PROMQL_REFERENCE_AGREEMENT_AVG_1H,
        "prunewatch:reference_agreement_avg:last": PROMQL_REFERENCE_AGREEMENT_BY_DOMAIN,
        "prunewatch:time_per_output_token_vs_dense:1h": PROMQL_TPOT_VS_DENSE,
        "prunewatch:ttft_per_prompt_token_vs_dense:1h": PROMQL_TTFT_VS_DENSE,
    }
    assert not any("continuation" in name for name in by_name)  # the secondary figure is not what alerts read
    buckets = [(labels["bucket"], expr) for name, expr, labels in records if labels is not None]
    assert buckets == [
        ("[0,0.35)", "count by (target, model, domain) (prunewatch_pruning_ratio >= 0 < 0.35)"),
        ("[0.35,0.42)", "count by (target, model, domain) (prunewatch_pruning_ratio >= 0.35 < 0.42)"),
        ("[0.42,0.47]", "count by (target, model, domain) (prunewatch_pruning_ratio >= 0.42 <= 0.47)"),
        ("(0.47,1]", "count by (target, model, domain) (prunewatch_pruning_ratio > 0.47)"),
    ]
    assert all(re.fullmatch(r"prunewatch:[a-z0-9_]+:(\d+[smhd]|last|window)", name) for name, _, _ in records)


def test_fallbacks_holds_and_slos_come_from_the_settings(defaults: RuleSettings) -> None:
    custom = RuleSettings(quality_red_line=0.42, quality_risk_ratio=0.5, ratio_low_for="3h", absent_for="20m",
                          ratio_buckets=(0.3, 0.4, 0.5), latency_vs_dense_max=2)
    rules = {(r["alert"], r["labels"]["severity"], r["labels"].get("source")): r
             for r in alert_rules(render_rules(custom))}
    red = rules[("PruningRatioQualityRisk", "warning", "fallback")]
    assert "> 0.42)" in red["expr"] and "above the red line 0.42" in red["annotations"]["description"]
    assert "> 0.5)" in rules[("PruningRatioQualityRisk", "critical", "fallback")]["expr"]
    # Where each fallback came from: this deployment's setting, or the shipped default; never "measured".
    assert "0.42 is a fallback (set in this deployment's rule settings, not measured on this model)" in \
        red["annotations"]["description"]
    assert "0.35 is a fallback (the rule settings' default, not measured on this model)" in \
        rules[("PruningRatioLow", "warning", "fallback")]["annotations"]["description"]
    assert "> 2)" in rules[("DecodeSlowerThanDense", "warning", "fallback")]["expr"]
    assert rules[("PruningRatioLow", "warning", None)]["for"] == "3h"
    assert rules[("ProbeDataAbsent", "critical", None)]["expr"] == "absent_over_time(prunewatch_probe_results_total[20m])"
    assert "prunewatch_pruning_ratio >= 0.4 <= 0.5" in render_rules(custom)
    # The seeds' per-request SLO and a per-token SLO are rules only where configured.
    assert not {"LatencySLOBreached", "LatencyPerTokenSLOBreached"} & {key[0] for key in rules}
    slo = {r["alert"]: r for r in alert_rules(render_rules(RuleSettings(latency_slo_s=1.3,
                                                                        latency_per_token_slo_s=0.08)))}
    assert slo["LatencySLOBreached"]["expr"] == f"{PROMQL_LATENCY_P99} > 1.3"
    assert slo["LatencyPerTokenSLOBreached"]["expr"] == f"{PROMQL_TPOT_15M} > 0.08"


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
    ({"latency_vs_dense_max": 0.9}, "greater than or equal to 1"),
    ({"absent_for": "0s"}, "absent_for must be positive"),
])
def test_bad_settings_are_refused_with_a_reason(overrides: dict, message: str) -> None:
    with pytest.raises(ValidationError, match=re.escape(message)):
        RuleSettings(**overrides)


def test_compare_parenthesises_binary_expressions() -> None:
    assert compare(PROMQL_FAILURE_RATE, ">", 0.2) == f"({PROMQL_FAILURE_RATE}) > 0.2"
    assert compare(PROMQL_LATENCY_P99, ">", 1.3) == f"{PROMQL_LATENCY_P99} > 1.3"


def test_measured_and_fallback_comparisons() -> None:
    assert compare_measured(PROMQL_RATIO_BY_DOMAIN, ">", "ratio_risk") == (
        f'{PROMQL_RATIO_BY_DOMAIN} > on(model) group_left(source) '
        'max by (model, source) (prunewatch_alert_threshold{kind="ratio_risk"})')
    assert compare_fallback(PROMQL_FAILURE_RATE, ">", 0.2, "x") == (
        f'(({PROMQL_FAILURE_RATE}) > 0.2) unless on(model) prunewatch_alert_threshold{{kind="x"}}')
