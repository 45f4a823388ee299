"""SQL of the PostgreSQL panels, over the collector's `probe_results` and `collector_rounds` tables.

Grafana expands the macros ($__timeFilter, $__timeGroupAlias, $__interval) and the template
variables ($model, $domain, $target, as quoted lists for `IN (...)`) before PostgreSQL sees the
query. Every figure here is a measured column of a probe result; nothing is estimated.
"""

from __future__ import annotations

from prunewatch.dashboards.rules import RatioBucket

SCOPE = "model IN ($model) AND domain IN ($domain) AND target IN ($target)"
"""The template-variable filter every probe_results query applies."""

WHERE = f"$__timeFilter(created_at) AND {SCOPE}"
PRUNED = f"{WHERE} AND NOT baseline"
"""Probe results of the pruned configuration only: dense baseline runs (sensitivity 0) would pull every
ratio, latency and quality figure toward the dense model's."""
TIME_BUCKET = "$__timeGroupAlias(created_at, $__interval)"


def _lines(*parts: str) -> str:
    return "\n".join(parts)


def ratio_bucket_case(buckets: tuple[RatioBucket, ...], column: str = "pruning_ratio") -> str:
    """A CASE expression naming the ratio bucket of `column`, with the recording rules' bucket labels."""
    arms = [f"WHEN {column} {'<=' if b.high_inclusive else '<'} {b.high:g} THEN '{b.label}'" for b in buckets[:-1]]
    return f"CASE {' '.join(arms)} ELSE '{buckets[-1].label}' END"


def ratio_bucket_counts(buckets: tuple[RatioBucket, ...]) -> str:
    """Successful probe results per ratio bucket over the time range."""
    return _lines(
        f"SELECT {ratio_bucket_case(buckets)} AS bucket, count(*) AS probes",
        "FROM probe_results",
        f"WHERE {PRUNED} AND status = 'ok' AND pruning_ratio IS NOT NULL",
        "GROUP BY 1 ORDER BY min(pruning_ratio)",
    )


# -- overview: latency vs pruning ratio, one point per probe, with a least-squares trend ----------
LATENCY_VS_RATIO = _lines(
    "SELECT pruning_ratio AS \"pruning ratio\",",
    "  inference_ms AS \"inference ms\",",
    "  regr_intercept(inference_ms, pruning_ratio) OVER ()",
    "    + regr_slope(inference_ms, pruning_ratio) OVER () * pruning_ratio AS \"least-squares trend ms\"",
    "FROM probe_results",
    f"WHERE {PRUNED} AND status = 'ok' AND pruning_ratio IS NOT NULL AND inference_ms IS NOT NULL",
    "ORDER BY 1",
)

# -- engine detail: figures the collector does not export as metrics -----------------------------
PEAK_MEMORY = _lines(
    f"SELECT {TIME_BUCKET}, domain AS metric, max(peak_memory_bytes) AS value",
    "FROM probe_results",
    f"WHERE {WHERE} AND status = 'ok' AND peak_memory_bytes IS NOT NULL",
    "GROUP BY 1, 2 ORDER BY 1",
)
FALLBACKS = _lines(
    f"SELECT {TIME_BUCKET}, fallback_reason AS metric, count(*) AS value",
    "FROM probe_results",
    f"WHERE {WHERE} AND fallback_reason IS NOT NULL",
    "GROUP BY 1, 2 ORDER BY 1",
)

# -- history ---------------------------------------------------------------------------------------
RATIO_BY_DOMAIN = _lines(
    f"SELECT {TIME_BUCKET}, domain AS metric, avg(pruning_ratio) AS value",
    "FROM probe_results",
    f"WHERE {PRUNED} AND status = 'ok' AND pruning_ratio IS NOT NULL",
    "GROUP BY 1, 2 ORDER BY 1",
)
LATENCY_PHASES = _lines(
    f"SELECT {TIME_BUCKET},",
    "  avg(preprocessing_ms) AS \"preprocessing\",",
    "  avg(inference_ms) AS \"inference\",",
    "  avg(postprocessing_ms) AS \"postprocessing\"",
    "FROM probe_results",
    f"WHERE {PRUNED} AND status = 'ok'",
    "GROUP BY 1 ORDER BY 1",
)
TOKEN_AGREEMENT = _lines(
    f"SELECT {TIME_BUCKET}, domain AS metric, avg(continuation_agreement) AS value",
    "FROM probe_results",
    f"WHERE {PRUNED} AND status = 'ok' AND continuation_agreement IS NOT NULL",
    "GROUP BY 1, 2 ORDER BY 1",
)
PERPLEXITY_DELTA = _lines(
    f"SELECT {TIME_BUCKET}, domain AS metric, avg(perplexity_delta_pct) AS value",
    "FROM probe_results",
    f"WHERE {PRUNED} AND status = 'ok' AND perplexity_delta_pct IS NOT NULL",
    "GROUP BY 1, 2 ORDER BY 1",
)
OUTCOMES = _lines(
    f"SELECT {TIME_BUCKET}, status AS metric, count(*) AS value",
    "FROM probe_results",
    f"WHERE {WHERE}",
    "GROUP BY 1, 2 ORDER BY 1",
)
FAILURES_BY_REASON = _lines(
    "SELECT failure_reason AS reason, target, domain, count(*) AS failures, max(created_at) AS last_seen,",
    "  (array_agg(error_message ORDER BY created_at DESC))[1] AS last_error",
    "FROM probe_results",
    f"WHERE {WHERE} AND status = 'failed'",
    "GROUP BY 1, 2, 3 ORDER BY failures DESC, last_seen DESC",
)
BY_PROBE_VERSION = _lines(
    "SELECT probe_id, probe_version, probe_hash, domain, count(*) AS results,",
    "  avg(pruning_ratio) AS mean_ratio, avg(continuation_agreement) AS mean_agreement, avg(inference_ms) AS mean_inference_ms",
    "FROM probe_results",
    f"WHERE {PRUNED} AND status = 'ok'",
    "GROUP BY 1, 2, 3, 4 ORDER BY 1, 2",
)
RECENT_RESULTS = _lines(
    "SELECT created_at AS \"time\", target, model, domain, probe_id, probe_version, status, failure_reason,",
    "  CASE WHEN baseline THEN 'dense baseline' ELSE 'pruned' END AS run, sensitivity,",
    "  pruning_ratio, inference_ms, ttft_ms, client_ttft_ms, tokens_per_s, client_decode_tokens_per_s,",
    "  continuation_agreement, fallback_reason",
    "FROM probe_results",
    f"WHERE {WHERE}",
    "ORDER BY created_at DESC LIMIT 200",
)
ROUNDS = _lines(
    "SELECT started_at AS \"time\", target, model, probes_ok, probes_failed,",
    "  extract(epoch from finished_at - started_at) AS duration_s",
    "FROM collector_rounds",
    "WHERE $__timeFilter(started_at) AND model IN ($model) AND target IN ($target)",
    "ORDER BY started_at DESC LIMIT 200",
)

# -- template variables ----------------------------------------------------------------------------
VAR_MODEL = "SELECT DISTINCT model FROM probe_results ORDER BY 1"
VAR_DOMAIN = "SELECT DISTINCT domain FROM probe_results WHERE model IN ($model) ORDER BY 1"
VAR_TARGET = "SELECT DISTINCT target FROM probe_results WHERE model IN ($model) ORDER BY 1"
