"""The overview dashboard: is pruning doing what it should, what does it save, is quality holding."""

from __future__ import annotations

from prunewatch.alerts.settings import RuleSettings
from prunewatch.dashboards import promql, sql
from prunewatch.dashboards.panels import (
    Datasources,
    Json,
    Layout,
    bargauge,
    dashboard,
    pg,
    prom,
    row,
    scatter,
    stat,
    table,
    textbox_variable,
    timeseries,
)
from prunewatch.dashboards.settings import DashboardSettings
from prunewatch.dashboards.variables import prometheus_variables

UID = "prunewatch-overview"

DASHED_THRESHOLDS: Json = {"matcher": {"id": "byRegexp", "options": "^threshold "},
                           "properties": [{"id": "custom.lineStyle", "value": {"fill": "dash", "dash": [10, 10]}},
                                          {"id": "custom.fillOpacity", "value": 0}]}
"""Measured thresholds drawn as dashed lines beside the figure they hold."""
INTERVAL_BOUNDS: Json = {"matcher": {"id": "byRegexp", "options": r"\(95%\)$"},
                         "properties": [{"id": "custom.lineStyle", "value": {"fill": "dot"}},
                                        {"id": "custom.fillOpacity", "value": 0}]}
"""The interval's bounds dotted around the estimate."""
PROMPTS_AXIS: Json = {"matcher": {"id": "byRegexp", "options": "^prompts "},
                      "properties": [{"id": "unit", "value": "none"},
                                     {"id": "custom.axisPlacement", "value": "right"}]}


def _rule_default(name: str) -> float:
    """A threshold's default in the alert rule settings (what the committed rules.yml is rendered from)."""
    return float(RuleSettings.model_fields[name].default)


def build_overview(settings: DashboardSettings) -> Json:
    ds = Datasources.from_settings(settings)
    p = ds.prometheus
    low, risk = _rule_default("ratio_low"), _rule_default("quality_risk_ratio")
    buckets = promql.ratio_buckets()
    layout = Layout()
    layout.add(row("Pruning"))
    layout.add(timeseries(
        "Pruning ratio by domain (measured)",
        "Share of the dense model's linear-layer FLOPs that were not executed, as counted by the engine, "
        "last probe of each probe id averaged per domain, and its 24h mean: the recorded series the "
        "ratio alerts evaluate. Dashed: the thresholds measured for each model (ratio_low, ratio_red_line, "
        "ratio_risk; source calibration or tune: `prunewatch alerts thresholds` says how). A model without "
        f"measured thresholds is alerted on the fallbacks {low:g} (ratio low) and {risk:g} (quality risk), "
        "the reference lines of this panel.",
        p, [prom("A", promql.ratio_by_domain(), "{{domain}} · {{model}} · {{target}}"),
            prom("B", promql.ratio_avg_24h(), "{{domain}} · {{target}} · 24h mean"),
            prom("C", promql.thresholds("ratio_low", "ratio_red_line", "ratio_risk"),
                 "threshold {{kind}} · {{model}} ({{source}})")],
        unit="percentunit", width=16, minimum=0, maximum=1,
        thresholds=[("transparent", None), ("red", low), ("orange", risk)], overrides=[DASHED_THRESHOLDS]))
    layout.add(bargauge(
        "Probes per ratio bucket (measured, last probe)",
        "How many probes (model × domain × probe id) had their last measured pruning ratio in each bucket "
        f"({', '.join(b.label for b in buckets)}), from the alert rules' recorded bucket counts. An empty "
        "bucket reads 0.",
        p, [prom(chr(ord("A") + i), promql.ratio_bucket_count(b), b.label, instant=True)
            for i, b in enumerate(buckets)],
        unit="none", width=8))
    layout.add(scatter(
        "Inference latency vs pruning ratio (measured, per probe)",
        "One point per successful probe result from the store (PostgreSQL): measured pruning ratio against "
        "measured prefill + decode time, with the least-squares line over the points in range (PostgreSQL "
        "regr_slope / regr_intercept). Probes differ in prompt length, so the line shows a correlation, not "
        "the effect of pruning alone.",
        ds.postgres, [pg("A", sql.LATENCY_VS_RATIO, table=True)],
        x_field="pruning ratio", line_fields=("least-squares trend ms",), unit="ms", x_unit="percentunit",
        width=12))
    layout.add(timeseries(
        "Inference latency, pruned vs dense baseline (measured, p50)",
        "Median prefill + decode time per target and domain, as the engine measured it: probes at the "
        "target's sensitivity (pruned) against the dense baseline runs the collector makes on the same "
        "engine every `baseline_every` rounds (sensitivity 0, same prompts). No dense line: the target has "
        "no baseline runs configured.",
        p, [prom("A", promql.INFERENCE_P50_PRUNED_BY_TARGET, "{{target}} · {{domain}} · pruned"),
            prom("B", promql.INFERENCE_P50_DENSE_BY_TARGET, "{{target}} · {{domain}} · dense")],
        unit="s", width=24, minimum=0))
    layout.add(stat(
        "Cost savings (estimated from configured prices)",
        "Formulas over the dashboard variables (configured prices, editable above) and measured figures: "
        "saved $ per 1M tokens = configured $/1M tokens × mean measured pruning ratio; GPU $/hour freed = "
        "configured GPU $/hour × mean measured ratio; GPU $ per 1M tokens = configured GPU $/hour ÷ "
        "(3600 × measured probe tokens/s) × 1e6. Savings are upper bounds: they assume cost scales with "
        "linear-layer work. Probe throughput is batch 1, not production throughput.",
        p, [prom("A", promql.cost_saved_per_million_tokens(), "saved $ / 1M tokens (estimated)", instant=True),
            prom("B", promql.cost_gpu_saved_per_hour(), "GPU $ / hour freed (estimated)", instant=True),
            prom("C", promql.COST_GPU_PER_MILLION_TOKENS, "GPU $ / 1M tokens at probe throughput (estimated)",
                 instant=True)],
        unit="currencyUSD", width=12, height=9, decimals=3))
    layout.add(row("Quality and health"))
    layout.add(timeseries(
        "Reference-scored agreement of served answers (measured, 95% interval over prompts)",
        "Share of the served answers' tokens equal to the dense reference's argmax given the served prefix, "
        "pooled over the prompts each target answered at its current sensitivity in its last rounds (estimate, "
        "solid), with the 95% interval bootstrapped over prompts (low and high, dotted): the series "
        "QualityAgreementLow reads, which fires when even the high bound is below the model's floor (dashed: "
        "measured for the model; a model without one is held to the 0.8 fallback). The worst probe's last answer "
        "is shown too. The prompts behind each estimate are in the next panel.",
        p, [prom("A", promql.reference_agreement("estimate"), "{{domain}} · {{model}} · {{target}}"),
            prom("B", promql.reference_agreement("low"), "{{domain}} · {{target}} · low (95%)"),
            prom("C", promql.reference_agreement("high"), "{{domain}} · {{target}} · high (95%)"),
            prom("D", promql.REFERENCE_AGREEMENT_WORST, "worst probe, last answer"),
            prom("E", promql.thresholds("quality_floor"), "threshold {{kind}} · {{model}} ({{source}})")],
        unit="percentunit", width=12, minimum=0, maximum=1, overrides=[INTERVAL_BOUNDS, DASHED_THRESHOLDS]))
    layout.add(timeseries(
        "Task pass rate and prompts behind the agreement (measured, counted)",
        "Share of the checked prompts whose newest served answer passed the probe's machine check (number, "
        "substring, code run), over the same window as the agreement; and how many prompts the agreement "
        "pools (right axis): an interval over two prompts is wide, and says so.",
        p, [prom("A", promql.task_pass_rate(), "pass rate · {{domain}} · {{target}}"),
            prom("B", promql.reference_agreement_prompts(), "prompts · {{domain}} · {{target}}")],
        unit="percentunit", width=12, minimum=0, overrides=[PROMPTS_AXIS]))
    layout.add(timeseries(
        "Continuation agreement (measured, secondary)",
        "Teacher-forced argmax agreement of the pruned model on the dense model's own continuation, last result "
        "of each probe averaged per domain: only a full check of a prunewatch engine gives it, and it is more "
        "forgiving than the reference-scored agreement (an answer that left the dense path early can still "
        "score high). No alert reads it.",
        p, [prom("A", promql.CONTINUATION_AGREEMENT, "{{domain}} · {{model}} · {{target}}")],
        unit="percentunit", width=12, minimum=0, maximum=1))
    layout.add(timeseries(
        "Probe failure rate (measured)",
        "Failed probes / all probes over 15 minutes, per model and domain: the recorded series the "
        "probe-failing alert evaluates.",
        p, [prom("A", promql.failure_rate(), "{{domain}} · {{model}} · {{target}}")],
        unit="percentunit", width=12, minimum=0, maximum=1))
    layout.add(table(
        "Alerts firing",
        "prunewatch alerts in state firing, as evaluated by Prometheus from prunewatch/alerts/rules.yml (the ALERTS "
        "series it writes for every firing rule); pending alerts are not shown.",
        p, [prom("A", promql.alerts_firing(), instant=True, table=True)], width=12))
    layout.add(stat(
        "Time since last successful probe (measured)",
        "Seconds since each target's last successful probe, from the collector's freshness gauge.",
        p, [prom("A", promql.LAST_SUCCESS_AGE, "{{target}} · {{model}}", instant=True)],
        unit="s", width=12, height=8, decimals=0))

    variables = prometheus_variables(p) + [
        textbox_variable("usd_per_million_tokens", "$ per 1M tokens (configured)", settings.usd_per_million_tokens,
                         "Configured price of 1M generated tokens; feeds the cost panel."),
        textbox_variable("gpu_usd_per_hour", "GPU $ per hour (configured)", settings.gpu_usd_per_hour,
                         "Configured cost of one GPU hour; feeds the cost panel."),
    ]
    return dashboard(uid=UID, title="prunewatch · overview",
                     description="Pruning ratio, cost, quality and alerts of the probed models.",
                     layout=layout, variables=variables, settings=settings)
