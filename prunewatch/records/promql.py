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


# -- quality of what was served (records/metrics.py: window gauges, per-probe reference agreement) ------
# The primary quality figure: reference-scored agreement of the served answers, pooled over the prompts a
# target answered at its current sensitivity in its last rounds, with a 95% interval bootstrapped over prompts.
def promql_quality_window(bound: str) -> str:
    """One bound (estimate, low, high) of the windowed reference-scored agreement per target, model and domain."""
    return f'max by (target, model, domain) (prunewatch_reference_agreement_window{{bound="{bound}"}})'


PROMQL_QUALITY_ESTIMATE = promql_quality_window("estimate")
PROMQL_QUALITY_LOW = promql_quality_window("low")
PROMQL_QUALITY_HIGH = promql_quality_window("high")
"""The interval's upper bound: below a floor, the breach is beyond sampling noise (QualityAgreementLow)."""
PROMQL_QUALITY_PROMPTS = "max by (target, model, domain) (prunewatch_reference_agreement_prompts)"
PROMQL_PASS_RATE = 'max by (target, model, domain) (prunewatch_task_pass_rate_window{bound="estimate"})'
PROMQL_REFERENCE_AGREEMENT_BY_DOMAIN = "avg by (target, model, domain) (prunewatch_reference_agreement)"
"""Reference-scored agreement of each probe's last served answer, averaged per target, model and domain."""
PROMQL_REFERENCE_AGREEMENT_AVG_1H = (
    "avg by (target, model, domain) (avg_over_time(prunewatch_reference_agreement[1h]))")
"""One hour of per-probe reference-scored agreement per target, model and domain (no interval: a trend line)."""


# -- latency per token against the dense baseline of the same target -----------------------------------
# Per token, so the figure does not move with answer length; against dense runs of the same prompts on the same
# target (the collector's baselines, every N-th round), so it does not move with the machine. Both sides over
# the same hour, so a load that slows the host slows both.
LATENCY_WINDOW = "1h"


def _pruned_over_dense(pruned: str, dense: str, window: str = LATENCY_WINDOW) -> str:
    return (f"avg by (target, model, domain) (avg_over_time({pruned}[{window}]))"
            f" / avg by (target, model, domain) (avg_over_time({dense}[{window}]))")


PROMQL_TPOT_VS_DENSE = _pruned_over_dense("prunewatch_time_per_output_token_seconds",
                                          "prunewatch_dense_time_per_output_token_seconds")
"""Pruned / dense time per output token (decode) over the last hour: above 1, pruning made decoding slower."""
PROMQL_TTFT_VS_DENSE = _pruned_over_dense("prunewatch_time_to_first_token_per_prompt_token_seconds",
                                          "prunewatch_dense_time_to_first_token_per_prompt_token_seconds")
"""Pruned / dense time to first token per prompt token over the last hour."""


def promql_latency_window(phase: str, bound: str) -> str:
    """One bound of the paired pruned/dense per-token time (records/latency_window.py) per target, model, domain:
    phase decode (per output token) or first_token (time to first token per prompt token)."""
    return (f'max by (target, model, domain) '
            f'(prunewatch_latency_vs_dense_window{{phase="{phase}",bound="{bound}"}})')


def promql_latency_window_by_phase(bound: str) -> str:
    """One bound of the paired pruned/dense per-token time per target, model, domain and phase (dashboards)."""
    return (f'max by (target, model, domain, phase) '
            f'(prunewatch_latency_vs_dense_window{{bound="{bound}"}})')


PROMQL_DECODE_VS_DENSE_LOW = promql_latency_window("decode", "low")
"""The paired decode interval's lower bound: above a threshold, "slower than dense" is beyond noise."""
PROMQL_FIRST_TOKEN_VS_DENSE_LOW = promql_latency_window("first_token", "low")
PROMQL_TPOT_15M = "avg by (target, model, domain) (avg_over_time(prunewatch_time_per_output_token_seconds[15m]))"
"""Pruned time per output token, 15 minutes: what a configured per-token SLO reads."""


def promql_threshold(kind: str) -> str:
    """A watched model's measured threshold of `kind`, one series per model (scrape labels dropped), carrying
    how it was obtained in `source`: the right-hand side of `on(model) group_left(source)`."""
    return f'max by (model, source) (prunewatch_alert_threshold{{kind="{kind}"}})'


def promql_has_threshold(kind: str) -> str:
    """The models that have a measured threshold of `kind`: `unless on(model)` this for the fallback rules."""
    return f'prunewatch_alert_threshold{{kind="{kind}"}}'


def promql_threshold_value(kind: str) -> str:
    """A template query (Go printf format, one %s for the model) for the threshold of `kind` of one model."""
    return f"prunewatch_alert_threshold{{model='%s',kind='{kind}'}}"


# -- the collector ------------------------------------------------------------------------------
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
