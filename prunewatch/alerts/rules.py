"""Build the Prometheus rule groups from the PromQL constants and `RuleSettings`, and render rules.yml.

rules.yml is generated, never edited by hand: every expression is a PROMQL_* constant (the same
text dashboards use) compared with a threshold from `RuleSettings`, so the numbers live in one
typed object and the PromQL in one module. A test keeps the committed file equal to the rendering.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import yaml

from prunewatch.alerts._parser import top_level_binary
from prunewatch.alerts.durations import format_duration
from prunewatch.alerts.settings import RuleSettings
from prunewatch.records.promql import (
    PROMQL_AGREEMENT_AVG_1H,
    PROMQL_AGREEMENT_BY_DOMAIN,
    PROMQL_BUFFER_DEPTH,
    PROMQL_FAILURE_RATE,
    PROMQL_LATENCY_P99,
    PROMQL_RATIO_AVG_24H,
    PROMQL_RATIO_BY_DOMAIN,
    promql_governor_clamps,
    promql_ratio_bucket_probes,
    promql_ratio_over_probes,
    promql_results_absent,
)

RECORDING_GROUP = "prunewatch-recording"
ALERTING_GROUP = "prunewatch-alerts"
RATIO_BUCKET_METRIC = "prunewatch:pruning_ratio_bucket_probes:last"

HEADER = (
    "# Generated from prunewatch/alerts/rules.py and RuleSettings defaults: do not edit by hand.\n"
    "# Regenerate with `prunewatch alerts render-rules --out prunewatch/alerts/rules.yml`; PRUNEWATCH_RULE_* variables\n"
    "# change thresholds. Prometheus and the embedded evaluator (`prunewatch run`) both load this file.\n"
)

RUNBOOK = ("Run `prunewatch doctor` (the main job, `prunewatch run`) or `prunewatch doctor --config <targets file> "
           "--target <name>` (a collector's target) on the collector host")
RUNBOOK_TARGET = ("Run `prunewatch doctor --config <targets file> --target {{ $labels.target }}` on the collector host "
                  "(plain `prunewatch doctor` for the main job's target, embedded; an alert without a target label is "
                  "about an engine's own live traffic)")
"""The runbook's first step for alerts grouped per target, model and domain: the doctor of that target."""

RECORDING_RULES: tuple[tuple[str, str], ...] = (
    ("prunewatch:pruning_ratio_avg:24h", PROMQL_RATIO_AVG_24H),
    ("prunewatch:pruning_ratio_avg:last", PROMQL_RATIO_BY_DOMAIN),
    ("prunewatch:inference_latency_p99:5m", PROMQL_LATENCY_P99),
    ("prunewatch:probe_failure_rate:15m", PROMQL_FAILURE_RATE),
    ("prunewatch:continuation_agreement_avg:1h", PROMQL_AGREEMENT_AVG_1H),
    ("prunewatch:continuation_agreement_avg:last", PROMQL_AGREEMENT_BY_DOMAIN),
)
"""Derived figures recorded for dashboards, each a PROMQL_* constant verbatim (bucket counts come on top)."""


@dataclass(frozen=True)
class AlertSpec:
    """One alerting rule before rendering."""

    name: str
    expr: str
    hold: str | None  # Prometheus `for:`; None fires on the first evaluation
    severity: str
    summary: str
    description: str
    runbook: str

    def as_rule(self) -> dict[str, Any]:
        rule: dict[str, Any] = {"alert": self.name, "expr": self.expr}
        if self.hold is not None:
            rule["for"] = self.hold
        rule["labels"] = {"severity": self.severity}
        rule["annotations"] = {"summary": self.summary, "description": self.description, "runbook": self.runbook}
        return rule


def compare(expr: str, op: str, threshold: float) -> str:
    """`expr op threshold`, parenthesised when `expr` is itself a binary operation, so precedence never bites."""
    left = f"({expr})" if top_level_binary(expr) else expr
    return f"{left} {op} {threshold:g}"


def _value(fmt: str) -> str:
    return '{{ $value | printf "' + fmt + '" }}'


WHERE = "{{ $labels.model }} on {{ $labels.domain }}"


def _unmeasured(settings: RuleSettings, field: str) -> str:
    """How a threshold nobody measured was chosen: the shipped default, or this deployment's own setting."""
    if getattr(settings, field) == type(settings).model_fields[field].default:
        return "is a configured default"
    return "was set in this deployment's rule settings"


def alert_specs(settings: RuleSettings) -> list[AlertSpec]:
    """The alerting rules, in evaluation order."""
    s = settings
    low, red, risk = f"{s.ratio_low:g}", f"{s.quality_red_line:g}", f"{s.quality_risk_ratio:g}"
    risk_for = format_duration(s.quality_risk_for)
    ratio_source = "measured by the engine, each probe's last result averaged over the domain"
    if s.thresholds_source:  # measured for this model by `prunewatch tune`
        low_origin = f"{low} was derived from a measurement: {s.thresholds_source}."
        red_origin = f"{red} was measured: {s.thresholds_source}."
        risk_origin = f"(measured: {s.thresholds_source}; check token agreement)"
    else:
        low_origin = f"{low} {_unmeasured(s, 'ratio_low')}, not measured on this model."
        red_origin = (f"{red} {_unmeasured(s, 'quality_red_line')}, not measured on this model; `prunewatch tune` "
                      "measures where quality falls for it.")
        risk_origin = f"({risk} {_unmeasured(s, 'quality_risk_ratio')}, not measured on this model; check token agreement)"
    return [
        AlertSpec(
            "PruningRatioLow", compare(PROMQL_RATIO_AVG_24H, "<", s.ratio_low), format_duration(s.ratio_low_for),
            "warning", f"Pruning ratio of {WHERE} below {low}",
            f"24 h average pruning ratio is {_value('%.3f')} (measured by the engine, averaged over the domain's "
            f"probes), under the configured floor {low} for at least {format_duration(s.ratio_low_for)}: pruning "
            f"saves little work for this domain. {low_origin}",
            f"{RUNBOOK_TARGET}, then compare the domain's calibration heatmap with the prompts it now serves."),
        AlertSpec(
            "PruningRatioQualityRisk", compare(PROMQL_RATIO_BY_DOMAIN, ">", s.quality_red_line), risk_for,
            "warning", f"Pruning ratio of {WHERE} above the red line {red}",
            f"Pruning ratio is {_value('%.3f')} ({ratio_source}), above the configured red line {red} for "
            f"{risk_for}. {red_origin}",
            f"{RUNBOOK_TARGET}, then lower the pruning sensitivity for this domain before quality drops."),
        AlertSpec(
            "PruningRatioQualityRisk", compare(PROMQL_RATIO_BY_DOMAIN, ">", s.quality_risk_ratio), risk_for,
            "critical", f"Pruning ratio of {WHERE} above {risk}: answer quality at risk",
            f"Pruning ratio is {_value('%.3f')} ({ratio_source}), above the configured quality limit {risk} for "
            f"{risk_for} {risk_origin}.",
            f"{RUNBOOK_TARGET}, then lower the pruning sensitivity for this domain and check token agreement."),
        AlertSpec(
            "QualityAgreementLow", compare(PROMQL_AGREEMENT_AVG_1H, "<", s.agreement_floor),
            format_duration(s.agreement_for), "warning",
            f"Token agreement of {WHERE} below {s.agreement_floor:g}",
            f"1 h average token agreement with the dense model is {_value('%.3f')} (measured: teacher-forced "
            f"argmax match rate), under the configured floor {s.agreement_floor:g} for "
            f"{format_duration(s.agreement_for)}.",
            f"{RUNBOOK_TARGET}, then compare the pruned and dense answers of this domain's probes."),
        AlertSpec(
            "LatencySLOBreached", compare(PROMQL_LATENCY_P99, ">", s.latency_slo_s), format_duration(s.latency_slo_for),
            "critical", f"p99 inference latency of {WHERE} above the {s.latency_slo_s:g} s SLO",
            f"p99 inference latency is {_value('%.2f')} s (estimated by histogram_quantile from the latency "
            f"histogram's buckets over 5m), above the configured SLO {s.latency_slo_s:g} s for "
            f"{format_duration(s.latency_slo_for)}.",
            f"{RUNBOOK_TARGET}, then check the engine's host load and the phase latencies (preprocessing, decode)."),
        AlertSpec(
            "ProbeFailing", compare(PROMQL_FAILURE_RATE, ">", s.failure_rate_max), format_duration(s.probe_failing_for),
            "critical", f"Probes failing for {WHERE}",
            f"{_value('%.2f')} of probe results failed over the last 15m (measured share), above the configured "
            f"{s.failure_rate_max:g} for {format_duration(s.probe_failing_for)}.",
            f"{RUNBOOK_TARGET}, then read the failure reasons in the collector log (timeout, engine_error, unreachable)."),
        AlertSpec(
            "ProbeDataAbsent", promql_results_absent(format_duration(s.absent_for)), None, "critical",
            f"No probe results for {format_duration(s.absent_for)}",
            f"No probe result was recorded in the last {format_duration(s.absent_for)} (configured window): the "
            "collector is down, stuck, or not scraped.",
            f"{RUNBOOK}, then check that the collector process runs and that Prometheus scrapes its /metrics."),
        AlertSpec(
            "CollectorBufferBacklog", compare(PROMQL_BUFFER_DEPTH, ">", s.buffer_backlog_max),
            format_duration(s.buffer_backlog_for), "warning",
            f"Collector buffer holds {_value('%.0f')} results",
            f"{_value('%.0f')} probe results (measured) wait on disk for the database, above the configured "
            f"{s.buffer_backlog_max} for {format_duration(s.buffer_backlog_for)}.",
            f"{RUNBOOK}, then check the database the collector writes to (connection, disk, locks)."),
        AlertSpec(
            "PruningGovernorClamped", compare(promql_governor_clamps(format_duration(s.governor_clamp_window)), ">", 0),
            None, "warning",
            "Quality governor lowered pruning of {{ $labels.target }} on {{ $labels.domain }}",
            f"The quality governor lowered the pruning sensitivity {_value('%.0f')} time(s) in the last "
            f"{format_duration(s.governor_clamp_window)}: the measured token agreement of the domain's probes fell "
            "below its floor, so live traffic now runs less pruned (and saves less) until agreement recovers.",
            "Run `prunewatch governor status` for the decision and its evidence, then compare the domain's "
            "pruned and dense answers."),
    ]


def recording_rules(settings: RuleSettings) -> list[dict[str, Any]]:
    """Recording rules `prunewatch:<what>:<window>`, including the ratio-bucket counts."""
    rules: list[dict[str, Any]] = [{"record": name, "expr": expr} for name, expr in RECORDING_RULES]
    a, b, c = settings.ratio_buckets
    buckets = (
        (f"[0,{a:g})", promql_ratio_bucket_probes(0.0, a, upper_closed=False)),
        (f"[{a:g},{b:g})", promql_ratio_bucket_probes(a, b, upper_closed=False)),
        (f"[{b:g},{c:g}]", promql_ratio_bucket_probes(b, c, upper_closed=True)),
        (f"({c:g},1]", promql_ratio_over_probes(c)),
    )
    rules.extend({"record": RATIO_BUCKET_METRIC, "expr": expr, "labels": {"bucket": bucket}}
                 for bucket, expr in buckets)
    return rules


def build_rule_groups(settings: RuleSettings) -> dict[str, Any]:
    """The rule file's content as plain data (what Prometheus' `groups:` expects)."""
    return {"groups": [
        {"name": RECORDING_GROUP, "rules": recording_rules(settings)},
        {"name": ALERTING_GROUP, "rules": [spec.as_rule() for spec in alert_specs(settings)]},
    ]}


def render_rules(settings: RuleSettings | None = None) -> str:
    """rules.yml text for `settings` (defaults: the committed file)."""
    data = build_rule_groups(settings if settings is not None else RuleSettings())
    return HEADER + yaml.safe_dump(data, sort_keys=False, width=1000, allow_unicode=True, default_flow_style=False)
