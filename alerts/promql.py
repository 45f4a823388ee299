"""PromQL of the figures alerting adds to collector/metrics.py's constants.

Same rule as there: one expression per figure, used verbatim by rules.yml (alerts and recording
rules) and by dashboards through the recording rules' names.
"""

from __future__ import annotations

PROMQL_AGREEMENT_BY_DOMAIN = "avg by (model, domain) (prunewatch_token_agreement)"
"""Token agreement with the dense model, last probe of each probe id, averaged per model and domain."""

PROMQL_AGREEMENT_AVG_1H = "avg by (model, domain) (avg_over_time(prunewatch_token_agreement[1h]))"
"""One hour of token agreement per model and domain: one probe's bad answer does not page anyone."""

PROMQL_BUFFER_DEPTH = "prunewatch_collector_buffer_depth"
"""Results the collector holds on disk because the database did not take them yet (gauge)."""


def promql_results_absent(window: str) -> str:
    """1 when no probe result has been recorded within `window` (a Prometheus duration such as 10m)."""
    return f"absent_over_time(prunewatch_probe_results_total[{window}])"


def promql_ratio_bucket_probes(lower: float, upper: float, *, upper_closed: bool) -> str:
    """How many probes (per model and domain) have a last pruning ratio inside [lower, upper) or [lower, upper]."""
    upper_op = "<=" if upper_closed else "<"
    return (f"count by (model, domain) (prunewatch_pruning_ratio >= {_number(lower)} {upper_op} {_number(upper)})")


def promql_ratio_over_probes(lower: float) -> str:
    """How many probes (per model and domain) have a last pruning ratio above `lower`."""
    return f"count by (model, domain) (prunewatch_pruning_ratio > {_number(lower)})"


def _number(value: float) -> str:
    return f"{value:g}"
