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
    LATENCY_WINDOW,
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
    promql_has_threshold,
    promql_ratio_bucket_probes,
    promql_ratio_over_probes,
    promql_results_absent,
    promql_threshold,
    promql_threshold_value,
)

RECORDING_GROUP = "prunewatch-recording"
ALERTING_GROUP = "prunewatch-alerts"
RATIO_BUCKET_METRIC = "prunewatch:pruning_ratio_bucket_probes:last"

HEADER = (
    "# Generated from prunewatch/alerts/rules.py and RuleSettings defaults: do not edit by hand.\n"
    "# Regenerate with `prunewatch alerts render-rules --out prunewatch/alerts/rules.yml`; PRUNEWATCH_RULE_* variables\n"
    "# change fallbacks and SLOs. Each watched model's own thresholds are series (prunewatch_alert_threshold), not\n"
    "# numbers in this file: one file serves every model. Prometheus and the embedded evaluator both load it.\n"
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
    ("prunewatch:reference_agreement_estimate:window", PROMQL_QUALITY_ESTIMATE),
    ("prunewatch:reference_agreement_low:window", PROMQL_QUALITY_LOW),
    ("prunewatch:reference_agreement_high:window", PROMQL_QUALITY_HIGH),
    ("prunewatch:reference_agreement_prompts:window", PROMQL_QUALITY_PROMPTS),
    ("prunewatch:task_pass_rate:window", PROMQL_PASS_RATE),
    ("prunewatch:reference_agreement_avg:1h", PROMQL_REFERENCE_AGREEMENT_AVG_1H),
    ("prunewatch:reference_agreement_avg:last", PROMQL_REFERENCE_AGREEMENT_BY_DOMAIN),
    (f"prunewatch:time_per_output_token_vs_dense:{LATENCY_WINDOW}", PROMQL_TPOT_VS_DENSE),
    (f"prunewatch:ttft_per_prompt_token_vs_dense:{LATENCY_WINDOW}", PROMQL_TTFT_VS_DENSE),
)
"""Derived figures recorded for dashboards, each a PROMQL_* constant verbatim (bucket counts come on top)."""

FALLBACK = "fallback"
"""The `source` label of an alert that compared with a rule-file fallback (the model has no measured threshold);
measured ones carry their threshold's source (calibration, tune)."""


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
    labels: tuple[tuple[str, str], ...] = ()  # beyond severity

    def as_rule(self) -> dict[str, Any]:
        rule: dict[str, Any] = {"alert": self.name, "expr": self.expr}
        if self.hold is not None:
            rule["for"] = self.hold
        rule["labels"] = {"severity": self.severity, **dict(self.labels)}
        rule["annotations"] = {"summary": self.summary, "description": self.description, "runbook": self.runbook}
        return rule


def compare(expr: str, op: str, threshold: float) -> str:
    """`expr op threshold`, parenthesised when `expr` is itself a binary operation, so precedence never bites."""
    return f"{_operand(expr)} {op} {threshold:g}"


def _operand(expr: str) -> str:
    return f"({expr})" if top_level_binary(expr) else expr


def compare_measured(expr: str, op: str, kind: str) -> str:
    """`expr op` this model's measured threshold of `kind`, carrying the threshold's `source` label."""
    return f"{_operand(expr)} {op} on(model) group_left(source) {promql_threshold(kind)}"


def compare_fallback(expr: str, op: str, threshold: float, kind: str) -> str:
    """`expr op threshold` for the models that have no measured threshold of `kind`."""
    return f"({compare(expr, op, threshold)}) unless on(model) {promql_has_threshold(kind)}"


def _value(fmt: str) -> str:
    return '{{ $value | printf "' + fmt + '" }}'


def _query(expr_format: str, args: str, fmt: str, missing: str = "n/a") -> str:
    """A template that quotes the first sample of a PromQL query (a Go printf format over `args`), or `missing`."""
    return ('{{ with printf "' + expr_format + '" ' + args + ' | query }}{{ . | first | value | printf "' + fmt
            + '" }}{{ else }}' + missing + "{{ end }}")


_TMD = "$labels.target $labels.model $labels.domain"
_SERIES = "{target='%s',model='%s',domain='%s'"


def _threshold(kind: str, fmt: str = "%.3f") -> str:
    return _query(promql_threshold_value(kind), "$labels.model", fmt)


def _window(bound: str) -> str:
    return _query("prunewatch_reference_agreement_window" + _SERIES + f",bound='{bound}'}}", _TMD, "%.3f")


def _latency_pairs(phase: str) -> str:
    return _query("prunewatch_latency_vs_dense_pairs" + _SERIES + f",phase='{phase}'}}", _TMD, "%.0f")


def _latency(phase: str, bound: str, fmt: str) -> str:
    return _query("prunewatch_latency_vs_dense_window" + _SERIES + f",phase='{phase}',bound='{bound}'}}", _TMD, fmt)


WHERE = "{{ $labels.model }} on {{ $labels.domain }}"
MEASURED = ("measured for {{ $labels.model }} ({{ $labels.source }}; `prunewatch alerts thresholds` shows how it was "
            "obtained)")


def _fallback_origin(settings: RuleSettings, field: str) -> str:
    """Why a fallback has its value: the shipped default (the seeds' figure) or this deployment's own setting."""
    value = getattr(settings, field)
    if value == type(settings).model_fields[field].default:
        origin = "the rule settings' default"
    else:
        origin = "set in this deployment's rule settings"
    return (f"{value:g} is a fallback ({origin}, not measured on this model): {{{{ $labels.model }}}} has no measured "
            "thresholds; `prunewatch run` measures them at calibration, `prunewatch tune` by a sweep")


def _pair(name: str, figure: str, op: str, kind: str, fallback_field: str, settings: RuleSettings, hold: str,
          severity: str, summary: tuple[str, str], description: tuple[str, str], runbook: str) -> list[AlertSpec]:
    """The measured rule (this model's threshold, joined on model) and its fallback (models without one).

    `summary` and `description` are (before, after) the threshold's text; the description's threshold text
    says how it was obtained."""
    value = getattr(settings, fallback_field)
    measured = AlertSpec(
        name, compare_measured(figure, op, kind), hold, severity, f"{summary[0]}{_threshold(kind)}{summary[1]}",
        f"{description[0]}{_threshold(kind)}, {MEASURED}{description[1]}", runbook)
    fallback = AlertSpec(
        name, compare_fallback(figure, op, value, kind), hold, severity, f"{summary[0]}{value:g}{summary[1]}",
        f"{description[0]}{value:g}{description[1]} {_fallback_origin(settings, fallback_field)}.", runbook,
        labels=(("source", FALLBACK),))
    return [measured, fallback]


def alert_specs(settings: RuleSettings) -> list[AlertSpec]:
    """The alerting rules, in evaluation order."""
    s = settings
    ratio_for, risk_for = format_duration(s.ratio_low_for), format_duration(s.quality_risk_for)
    quality_for, latency_for = format_duration(s.agreement_for), format_duration(s.latency_vs_dense_for)
    ratio_source = "measured by the engine, each probe's last result averaged over the domain"
    specs = _pair(
        "PruningRatioLow", PROMQL_RATIO_AVG_24H, "<", "ratio_low", "ratio_low", s, ratio_for, "warning",
        (f"Pruning ratio of {WHERE} below ", ""),
        (f"24 h average pruning ratio is {_value('%.3f')} (measured by the engine, averaged over the domain's "
         f"probes), under ", f", for at least {ratio_for}: pruning saves far less work for this domain than it did "
                            "where the threshold was measured."),
        f"{RUNBOOK_TARGET}, then compare the domain's calibration heatmap with the prompts it now serves.")
    specs += _pair(
        "PruningRatioQualityRisk", PROMQL_RATIO_BY_DOMAIN, ">", "ratio_red_line", "quality_red_line", s, risk_for,
        "warning", (f"Pruning ratio of {WHERE} above the red line ", ""),
        (f"Pruning ratio is {_value('%.3f')} ({ratio_source}), above the red line ",
         f", for {risk_for}: past the range where this model's quality was measured to hold."),
        f"{RUNBOOK_TARGET}, then lower the pruning sensitivity for this domain before quality drops.")
    specs += _pair(
        "PruningRatioQualityRisk", PROMQL_RATIO_BY_DOMAIN, ">", "ratio_risk", "quality_risk_ratio", s, risk_for,
        "critical", (f"Pruning ratio of {WHERE} above ", ": answer quality at risk"),
        (f"Pruning ratio is {_value('%.3f')} ({ratio_source}), above the quality-risk line ",
         f", for {risk_for}: check the reference-scored agreement of this domain (QualityAgreementLow)."),
        f"{RUNBOOK_TARGET}, then lower the pruning sensitivity for this domain and check the reference-scored "
        "agreement.")
    specs += _pair(
        "QualityAgreementLow", PROMQL_QUALITY_HIGH, "<", "quality_floor", "agreement_floor", s, quality_for,
        "warning", (f"Reference-scored agreement of {WHERE} below ", ""),
        (f"Reference-scored agreement of the served answers is {_window('estimate')} [{_window('low')}, "
         f"{_value('%.3f')}] over {_query('prunewatch_reference_agreement_prompts' + _SERIES + '}', _TMD, '%.0f')} "
         "prompts (measured: served tokens equal to the dense reference's argmax given the served prefix, pooled "
         "over the prompts answered at the current sensitivity in the last rounds; 95% bootstrap interval over "
         "prompts). Even the interval's upper bound is below the floor ",
         f", for {quality_for}: a loss beyond sampling noise."),
        f"{RUNBOOK_TARGET}, then compare the served and reference answers of this domain's probes (the store's "
        "divergence_at says where they part).")
    for name, figure, kind, what, phase in (
            ("DecodeSlowerThanDense", PROMQL_DECODE_VS_DENSE_LOW, "tpot_vs_dense_max", "time per output token",
             "decode"),
            ("FirstTokenSlowerThanDense", PROMQL_FIRST_TOKEN_VS_DENSE_LOW, "ttft_vs_dense_max",
             "time to first token per prompt token", "first_token")):
        specs += _pair(
            name, figure, ">", kind, "latency_vs_dense_max", s, latency_for, "warning",
            (f"Pruned {what} of {WHERE} above dense x ", ""),
            (f"Pruned {what} is {_latency(phase, 'estimate', '%.2f')}x [{_value('%.2f')}, "
             f"{_latency(phase, 'high', '%.2f')}] the dense time of the same prompts over "
             f"{_latency_pairs(phase)} "
             "prompt pairs (measured by the engine: each probe pruned and dense back to back in the baseline rounds, "
             "the last rounds pooled; 95% bootstrap interval over pairs). Even the interval's lower bound is above "
             "x ",
             f", for {latency_for}: pruning made it slower than running dense, beyond the noise of the host."),
            f"{RUNBOOK_TARGET}, then check the engine's host load, the phase latencies and whether the sparse "
            "kernel is in use (`prunewatch doctor`).")
    if s.latency_per_token_slo_s is not None:
        slo_for = format_duration(s.latency_per_token_slo_for)
        specs.append(AlertSpec(
            "LatencyPerTokenSLOBreached", compare(PROMQL_TPOT_15M, ">", s.latency_per_token_slo_s), slo_for,
            "critical", f"Time per output token of {WHERE} above the {s.latency_per_token_slo_s:g} s SLO",
            f"Time per output token is {_value('%.4f')} s (measured by the engine, 15m average of the probes), "
            f"above the configured SLO {s.latency_per_token_slo_s:g} s for {slo_for}.",
            f"{RUNBOOK_TARGET}, then check the engine's host load and the phase latencies."))
    if s.latency_slo_s is not None:
        slo_for = format_duration(s.latency_slo_for)
        specs.append(AlertSpec(
            "LatencySLOBreached", compare(PROMQL_LATENCY_P99, ">", s.latency_slo_s), slo_for,
            "critical", f"p99 inference latency of {WHERE} above the {s.latency_slo_s:g} s SLO",
            f"p99 inference latency is {_value('%.2f')} s (estimated by histogram_quantile from the latency "
            f"histogram's buckets over 5m), above the configured SLO {s.latency_slo_s:g} s for {slo_for}; a time "
            "per request, so it moves with answer length.",
            f"{RUNBOOK_TARGET}, then check the engine's host load and the phase latencies (preprocessing, decode)."))
    specs += [
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
            f"{format_duration(s.governor_clamp_window)}: the measured reference-scored agreement of the domain's "
            "answers fell below its floor, so live traffic now runs less pruned (and saves less) until it recovers.",
            "Run `prunewatch governor status` for the decision and its evidence, then compare the domain's "
            "served and reference answers."),
    ]
    return specs


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
