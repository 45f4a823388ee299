"""PromQL of the dashboard panels, built from the collector's metric names and the alert recording rules.

Derived figures that alerts also evaluate (ratio by domain, 24h ratio, p99 latency, failure rate,
reference-scored agreement and its interval, per-token latency against dense, ratio buckets) are read from the recording rules that record the PROMQL_*
constants verbatim (prunewatch/alerts/rules.yml), narrowed to the dashboard's template variables by
`scoped`: a dashboard and an alert can never disagree about what a figure means. Everything
else is written here against metric names of `prunewatch.records.metrics`.
"""

from __future__ import annotations

import re

from prunewatch.dashboards.rules import RatioBucket, load_rule_file, recorded
from prunewatch.records.promql import (
    PROMQL_DECODE_RATIO_BY_DOMAIN,
    PROMQL_FAILURE_RATE,
    PROMQL_LATENCY_P99,
    PROMQL_PASS_RATE,
    PROMQL_PREFILL_RATIO_BY_DOMAIN,
    PROMQL_QUALITY_ESTIMATE,
    PROMQL_QUALITY_HIGH,
    PROMQL_QUALITY_LOW,
    PROMQL_QUALITY_PROMPTS,
    PROMQL_RATIO_AVG_24H,
    PROMQL_RATIO_BY_DOMAIN,
    promql_latency_window_by_phase,
)

MODEL_DOMAIN = 'model=~"$model", domain=~"$domain"'
"""Label matchers of the per-probe metrics and the figures recorded from them. These carry a target too
(none for an engine's own live traffic), which their legends show; the target variable narrows only the
per-target panels."""

MODEL_TARGET = 'model=~"$model", target=~"$target"'
"""Label matchers of the per-target series (probe wall time, freshness)."""

# A prunewatch series name (metric or `prunewatch:...` recording rule), with its optional {matchers}.
_SELECTOR = re.compile(r"(?<![\w:])(prunewatch[_:][A-Za-z0-9_:]*)(\{[^}]*\})?")


def scoped(expr: str, matchers: str = MODEL_DOMAIN) -> str:
    """`expr` with `matchers` added to every prunewatch series selector in it.

    >>> scoped('avg(prunewatch_x[5m]) / sum(prunewatch:y{a="b"})', 'm="1"')
    'avg(prunewatch_x{m="1"}[5m]) / sum(prunewatch:y{a="b", m="1"})'
    """

    def add(match: re.Match[str]) -> str:
        name, braces = match.group(1), match.group(2)
        inner = braces[1:-1].strip() if braces else ""
        return f"{name}{{{inner + ', ' if inner else ''}{matchers}}}"

    result, count = _SELECTOR.subn(add, expr)
    if count == 0:
        raise ValueError(f"no prunewatch series selector to scope in {expr!r}")
    return result


# -- recorded figures (the alerts' own series) -------------------------------------------------
def ratio_by_domain() -> str:
    return scoped(recorded(PROMQL_RATIO_BY_DOMAIN))


def ratio_avg_24h() -> str:
    return scoped(recorded(PROMQL_RATIO_AVG_24H))


def failure_rate() -> str:
    return scoped(recorded(PROMQL_FAILURE_RATE))


def inference_p99() -> str:
    return scoped(recorded(PROMQL_LATENCY_P99))


def reference_agreement(bound: str) -> str:
    """The windowed reference-scored agreement (estimate, low or high), as QualityAgreementLow reads it."""
    expr = {"estimate": PROMQL_QUALITY_ESTIMATE, "low": PROMQL_QUALITY_LOW, "high": PROMQL_QUALITY_HIGH}[bound]
    return scoped(recorded(expr))


def reference_agreement_prompts() -> str:
    return scoped(recorded(PROMQL_QUALITY_PROMPTS))


def task_pass_rate() -> str:
    return scoped(recorded(PROMQL_PASS_RATE))


def latency_vs_dense(bound: str) -> str:
    """The paired pruned/dense per-token time the latency rules read, per phase: bound estimate or low."""
    return scoped(promql_latency_window_by_phase(bound))


def thresholds(*kinds: str) -> str:
    """The selected models' measured alert thresholds of these kinds (what the rules compare with, on(model))."""
    return (f'max by (model, kind, source) (prunewatch_alert_threshold{{kind=~"{"|".join(kinds)}", '
            f'model=~"$model"}})')


CONTINUATION_AGREEMENT = scoped("avg by (target, model, domain) (prunewatch_continuation_agreement)")
"""Secondary: teacher-forced agreement on the dense continuation (a full check of a prunewatch engine only)."""


def ratio_buckets() -> tuple[RatioBucket, ...]:
    return load_rule_file().buckets


def ratio_bucket_count(bucket: RatioBucket) -> str:
    """Probes (model x domain x probe) whose last measured ratio is in `bucket`, summed over the selection.

    `or vector(0)` makes an empty bucket read 0 instead of "no data": zero probes is a fact.
    """
    metric = load_rule_file().bucket_metric
    return f'sum({metric}{{bucket="{bucket.label}", {MODEL_DOMAIN}}}) or vector(0)'


def alerts_firing() -> str:
    """Firing alerts of the prunewatch rule file (other rules on a shared Prometheus stay out)."""
    names = "|".join(load_rule_file().alert_names)
    return f'ALERTS{{alertstate="firing", alertname=~"{names}"}}'


# Cost: configured prices (dashboard variables) x measured figures. Upper bounds: they assume cost
# scales with linear-layer work, which holds best for memory-bound decode (bytes ~ FLOPs skipped).
def cost_saved_per_million_tokens() -> str:
    return f"${{usd_per_million_tokens}} * avg({ratio_by_domain()})"


def cost_gpu_saved_per_hour() -> str:
    return f"${{gpu_usd_per_hour}} * avg({ratio_by_domain()})"


COST_GPU_PER_MILLION_TOKENS = (
    f"${{gpu_usd_per_hour}} * 1e6 / (3600 * avg(prunewatch_tokens_per_second{{{MODEL_DOMAIN}}}))"
)

# -- raw figures ---------------------------------------------------------------------------------
REFERENCE_AGREEMENT_WORST = f"min(prunewatch_reference_agreement{{{MODEL_DOMAIN}}})"
"""The worst probe's last served answer, reference-scored."""
LAST_SUCCESS_AGE = f"time() - max by (model, target) (prunewatch_last_success_timestamp_seconds{{{MODEL_TARGET}}})"


def _phase_mean(metric: str) -> str:
    """Mean seconds per probe of one latency phase: histogram sum rate over count rate."""
    total = f"{metric}_sum{{{MODEL_DOMAIN}}}"
    count = f"{metric}_count{{{MODEL_DOMAIN}}}"
    return f"sum(rate({total}[$__rate_interval])) / sum(rate({count}[$__rate_interval]))"


def _quantile(q: float, metric: str, window: str = "$__rate_interval") -> str:
    return f"histogram_quantile({q}, sum by (le, model, domain) (rate({metric}_bucket{{{MODEL_DOMAIN}}}[{window}])))"


PHASE_MEANS = {
    "preprocessing": _phase_mean("prunewatch_preprocessing_latency_seconds"),
    "inference": _phase_mean("prunewatch_inference_latency_seconds"),
    "postprocessing": _phase_mean("prunewatch_postprocessing_latency_seconds"),
    "quality check": _phase_mean("prunewatch_quality_check_latency_seconds"),
}
PHASE_RATIOS = {  # measured per phase, last probe per (model, domain, probe), averaged per domain
    "prefill": scoped(PROMQL_PREFILL_RATIO_BY_DOMAIN),
    "decode": scoped(PROMQL_DECODE_RATIO_BY_DOMAIN),
}
INFERENCE_P50 = _quantile(0.5, "prunewatch_inference_latency_seconds", "5m")  # the recorded p99's window
_TARGET_DOMAIN = 'model=~"$model", domain=~"$domain", target=~"$target"'


def _median_by_target(metric: str) -> str:
    return (f"histogram_quantile(0.5, sum by (le, target, domain) "
            f"(rate({metric}_bucket{{{_TARGET_DOMAIN}}}[$__rate_interval])))")


INFERENCE_P50_PRUNED_BY_TARGET = _median_by_target("prunewatch_inference_latency_seconds")
INFERENCE_P50_DENSE_BY_TARGET = _median_by_target("prunewatch_dense_inference_latency_seconds")
TTFT_P50 = _quantile(0.5, "prunewatch_time_to_first_token_seconds")
TTFT_P95 = _quantile(0.95, "prunewatch_time_to_first_token_seconds")
TOKENS_PER_SECOND = f"avg by (model, domain) (prunewatch_tokens_per_second{{{MODEL_DOMAIN}}})"
DRAM_BYTES_PER_INSTRUCTION = (
    f"avg by (model, domain, source) (prunewatch_dram_bytes_per_instruction{{{MODEL_DOMAIN}}})"
)
FAILURES_BY_REASON = (  # every reason exists at 0 from the first result: only those that happened are rows
    f"sum by (domain, reason) (increase(prunewatch_probe_failures_total{{{MODEL_DOMAIN}}}[$__range])) > 0")
PROBE_WALL_TIME = (
    f"sum by (target, status) (rate(prunewatch_probe_duration_seconds_sum{{{MODEL_TARGET}}}[$__rate_interval]))"
    f" / sum by (target, status) (rate(prunewatch_probe_duration_seconds_count{{{MODEL_TARGET}}}[$__rate_interval]))"
)
RESULTS_BY_STATUS = f"sum by (status) (increase(prunewatch_probe_results_total{{{MODEL_DOMAIN}}}[$__range]))"

# -- serving under load: what `prunewatch serve` exports from its batcher (prunewatch.server.metrics) -----------
MODEL_ONLY = 'model=~"$model"'
"""Label matcher of a server's own series, which carry the model only."""
STEPPER_SHARE = (
    f"sum by (model, activity) (rate(prunewatch_batcher_seconds_total{{{MODEL_ONLY}}}[$__rate_interval]))"
    f" / ignoring (activity) group_left sum by (model) "
    f"(rate(prunewatch_batcher_seconds_total{{{MODEL_ONLY}}}[$__rate_interval]))"
)
"""Share of the batcher's stepper time per activity (decode, jobs, gather, idle); the shares add up to 1."""
DECODE_STEP_SECONDS_BY_ROWS = (
    f"sum by (model, rows) (rate(prunewatch_decode_step_seconds_total{{{MODEL_ONLY}}}[$__rate_interval]))"
    f" / sum by (model, rows) (rate(prunewatch_decode_steps_total{{{MODEL_ONLY}}}[$__rate_interval]))"
)
"""Mean wall time of a batched decode step of each size: what one more row in a step costs."""
DECODE_STEPS_BY_ROWS = f"sum by (model, rows) (rate(prunewatch_decode_steps_total{{{MODEL_ONLY}}}[$__rate_interval]))"
KV_CACHE_RESERVED = f"max by (model) (prunewatch_kv_cache_reserved_bytes{{{MODEL_ONLY}}})"
KV_CACHE_BUDGET = f"max by (model) (prunewatch_kv_cache_budget_bytes{{{MODEL_ONLY}}})"

# -- template variables --------------------------------------------------------------------------
VAR_MODEL = "label_values(prunewatch_probe_results_total, model)"
VAR_DOMAIN = 'label_values(prunewatch_probe_results_total{model=~"$model"}, domain)'
VAR_TARGET = 'label_values(prunewatch_probe_duration_seconds_count{model=~"$model"}, target)'
