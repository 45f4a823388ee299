"""The history dashboard: the PostgreSQL store, every probe result since the collector started."""

from __future__ import annotations

from prunewatch.dashboards import sql
from prunewatch.dashboards.panels import (
    Datasources,
    Json,
    Layout,
    barchart,
    dashboard,
    pg,
    row,
    table,
    timeseries,
)
from prunewatch.dashboards.promql import ratio_buckets
from prunewatch.dashboards.settings import DashboardSettings
from prunewatch.dashboards.variables import postgres_variables

UID = "prunewatch-history"


def build_history(settings: DashboardSettings) -> Json:
    ds = Datasources.from_settings(settings)
    db = ds.postgres
    layout = Layout()
    layout.add(row("Trends (measured, per probe result)"))
    layout.add(timeseries(
        "Pruning ratio by domain (measured)",
        "Mean measured pruning ratio (share of linear-layer FLOPs not executed) of the successful probe "
        "results per domain and interval.",
        db, [pg("A", sql.RATIO_BY_DOMAIN)], unit="percentunit", width=12, minimum=0, maximum=1))
    layout.add(barchart(
        "Probe results per ratio bucket (counted)",
        "Successful probe results in the time range per pruning-ratio bucket (the buckets of the alert "
        "rules' recorded counts: under-pruned, target, quality risk, past the red line).",
        db, [pg("A", sql.ratio_bucket_counts(ratio_buckets()), table=True)], x_field="bucket", width=12))
    layout.add(timeseries(
        "Latency phases (measured mean)",
        "Mean preprocessing, inference (prefill + decode) and postprocessing milliseconds per interval.",
        db, [pg("A", sql.LATENCY_PHASES)], unit="ms", width=12, bars=True, stacked=True))
    layout.add(timeseries(
        "Probe outcomes (counted)",
        "Probe results per interval by status (ok / failed).",
        db, [pg("A", sql.OUTCOMES)], unit="none", width=12, bars=True, stacked=True, minimum=0))
    layout.add(row("Quality of what was served (measured against a dense reference)"))
    layout.add(timeseries(
        "Reference-scored agreement by domain (measured)",
        "Share of the served answers' tokens equal to the dense reference's argmax given the served prefix, "
        "pooled over the answers of each domain and interval (matched tokens ÷ scored tokens; dense baselines "
        "and dense fallbacks left out). The primary quality figure; its 95% interval over prompts is on the "
        "overview dashboard.",
        db, [pg("A", sql.REFERENCE_AGREEMENT)], unit="percentunit", width=12, minimum=0, maximum=1))
    layout.add(timeseries(
        "Task pass rate, pruned vs dense (measured)",
        "Share of checked answers that passed their probe's machine check (number, substring, code run), per "
        "domain and interval: pruned answers and the dense baseline runs' answers to the same probes.",
        db, [pg("A", sql.TASK_PASS_RATE)], unit="percentunit", width=12, minimum=0, maximum=1))
    layout.add(timeseries(
        "Continuation agreement by domain (measured, secondary)",
        "Teacher-forced argmax agreement of the pruned model on the dense model's own continuation, per domain "
        "and interval: only a full check of a prunewatch engine gives it, and it is more forgiving than the "
        "reference-scored agreement (an answer that left the dense path early can still score high here).",
        db, [pg("A", sql.CONTINUATION_AGREEMENT)], unit="percentunit", width=12, minimum=0, maximum=1))
    layout.add(timeseries(
        "Perplexity delta by domain, % (measured, secondary)",
        "Mean (pruned − dense) ÷ dense perplexity of the dense continuation, in percent, per domain and interval "
        "(from the same full check as the continuation agreement).",
        db, [pg("A", sql.PERPLEXITY_DELTA)], unit="percent", width=12))
    layout.add(row("Records"))
    layout.add(table(
        "Failures by reason (counted)",
        "Failed probe results in the time range by reason, target and domain, with the latest error message.",
        db, [pg("A", sql.FAILURES_BY_REASON, table=True)], width=12))
    layout.add(table(
        "Results by probe version",
        "Per probe id and version (with its content hash): result count and measured means. A changed "
        "prompt is a new version, so rows never mix two prompts.",
        db, [pg("A", sql.BY_PROBE_VERSION, table=True)], width=12))
    layout.add(table(
        "Recent probe results",
        "The latest 200 probe results in the time range, as stored (empty cells: not measured by that target).",
        db, [pg("A", sql.RECENT_RESULTS, table=True)], width=24, height=10))
    layout.add(table(
        "Collector rounds (counted)",
        "The latest 200 probe rounds: probes ok / failed and the round's wall time.",
        db, [pg("A", sql.ROUNDS, table=True)], width=24))
    return dashboard(uid=UID, title="prunewatch · history",
                     description="Every probe result in the PostgreSQL store: trends, quality, failures, rounds.",
                     layout=layout, variables=postgres_variables(db), settings=settings)
