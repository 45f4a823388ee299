"""The PromQL of every derived figure, in one place: one expression per figure.

Alert rules (prunewatch/alerts/rules.yml, alerting and recording rules) use these very strings, dashboards read
them through the recording rules' names, and tests evaluate them against a real Prometheus.
"""

from __future__ import annotations

# -- probe results (prunewatch/records/metrics.py) -------------------------------------------------------
# Grouped by target as well as model and domain: two engines serving one model are two things to
# alert on (an average over both would let one hide the other's risk), and each alert names the
# engine it is about. An engine's own live traffic has no target label: it forms a group of its own.
PROMQL_RATIO_AVG_24H = "avg by (target, model, domain) (avg_over_time(prunewatch_pruning_ratio[24h]))"
PROMQL_RATIO_BY_DOMAIN = "avg by (target, model, domain) (prunewatch_pruning_ratio)"
PROMQL_DECODE_RATIO_BY_DOMAIN = "avg by (target, model, domain) (prunewatch_decode_pruning_ratio)"
PROMQL_PREFILL_RATIO_BY_DOMAIN = "avg by (target, model, domain) (prunewatch_prefill_pruning_ratio)"
PROMQL_LATENCY_P99 = (
    "histogram_quantile(0.99, sum by (le, target, model, domain) (rate(prunewatch_inference_latency_seconds_bucket[5m])))"
)
PROMQL_FAILURE_RATE = (
    "sum by (target, model, domain) (rate(prunewatch_probe_failures_total[15m]))"
    " / clamp_min(sum by (target, model, domain) (rate(prunewatch_probe_results_total[15m])), 1e-9)"
)


# -- live traffic (prunewatch/server/metrics.py) ----------------------------------------------------------
# Traffic-weighted pruning ratio over live requests: the share of dense linear FLOPs skipped.
# The ratio gauge holds the last request only; this is the figure to chart and alert on for traffic.
PROMQL_LIVE_RATIO_5M = (
    "1 - sum by (model, domain) (rate(prunewatch_executed_flops_total[5m]))"
    " / clamp_min(sum by (model, domain) (rate(prunewatch_dense_flops_total[5m])), 1e-9)"
)
PROMQL_ERROR_RATE_5M = (
    'sum by (model, endpoint) (rate(prunewatch_requests_total{status=~"5.."}[5m]))'
    " / clamp_min(sum by (model, endpoint) (rate(prunewatch_requests_total[5m])), 1e-9)"
)
PROMQL_REQUEST_P99_5M = (
    "histogram_quantile(0.99, sum by (le, model, endpoint) (rate(prunewatch_request_duration_seconds_bucket[5m])))"
)


# -- alerting ---------------------------------------------------------------------------------
PROMQL_AGREEMENT_BY_DOMAIN = "avg by (target, model, domain) (prunewatch_continuation_agreement)"
"""Token agreement with the dense model, last probe of each probe id, averaged per target, model and domain."""

PROMQL_AGREEMENT_AVG_1H = "avg by (target, model, domain) (avg_over_time(prunewatch_continuation_agreement[1h]))"
"""One hour of token agreement per target, model and domain: one probe's bad answer does not page anyone."""

PROMQL_BUFFER_DEPTH = "prunewatch_collector_buffer_depth"
"""Results the collector holds on disk because the database did not take them yet (gauge)."""


def promql_results_absent(window: str) -> str:
    """1 when no probe result has been recorded within `window` (a Prometheus duration such as 10m)."""
    return f"absent_over_time(prunewatch_probe_results_total[{window}])"


def promql_ratio_bucket_probes(lower: float, upper: float, *, upper_closed: bool) -> str:
    """How many probes (per target, model and domain) have a last pruning ratio inside [lower, upper) or [lower, upper]."""
    upper_op = "<=" if upper_closed else "<"
    return (f"count by (target, model, domain) (prunewatch_pruning_ratio >= {_number(lower)} {upper_op} "
            f"{_number(upper)})")


def promql_ratio_over_probes(lower: float) -> str:
    """How many probes (per target, model and domain) have a last pruning ratio above `lower`."""
    return f"count by (target, model, domain) (prunewatch_pruning_ratio > {_number(lower)})"


def _number(value: float) -> str:
    return f"{value:g}"


# -- quality governor (prunewatch/records/governor_metrics.py) ---------------------------------------------
PROMQL_GOVERNOR_SETTING = "max by (target, domain) (prunewatch_governor_setting)"
"""The pruning sensitivity the quality governor holds per target and domain (0 runs dense)."""


def promql_governor_clamps(window: str) -> str:
    """Rounds within `window` in which the governor lowered a (target, domain)'s sensitivity (a floor breach)."""
    return f"sum by (target, domain) (increase(prunewatch_governor_clamps_total[{window}]))"
