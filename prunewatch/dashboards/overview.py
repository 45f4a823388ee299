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
        f"ratio alerts evaluate. Reference lines: {low:g} (ratio-low alert) and {risk:g} (quality-risk "
        "alert), the alert rules' default thresholds.",
        p, [prom("A", promql.ratio_by_domain(), "{{domain}} · {{model}} · {{target}}"),
            prom("B", promql.ratio_avg_24h(), "{{domain}} · {{target}} · 24h mean")],
        unit="percentunit", width=16, minimum=0, maximum=1,
        thresholds=[("transparent", None), ("red", low), ("orange", risk)]))
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
        "Token agreement with the dense model (measured)",
        "Teacher-forced argmax agreement of the pruned model with the dense model on the dense continuation "
        "of each probe: last result of each probe id averaged per domain (the recorded series the agreement "
        "alert family uses), and the worst probe. 1.0 means every token matched.",
        p, [prom("A", promql.continuation_agreement_by_domain(), "{{domain}} · {{model}} · {{target}}"),
            prom("B", promql.TOKEN_AGREEMENT_WORST, "worst probe")],
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
