"""The engine detail dashboard: where the time goes, how fast tokens come, what memory and DRAM cost."""

from __future__ import annotations

from prunewatch.dashboards import promql, sql
from prunewatch.dashboards.overview import DASHED_THRESHOLDS
from prunewatch.dashboards.panels import (
    Datasources,
    Json,
    Layout,
    dashboard,
    pg,
    prom,
    row,
    table,
    timeseries,
)
from prunewatch.dashboards.settings import DashboardSettings
from prunewatch.dashboards.variables import prometheus_variables
from prunewatch.records.promql import PROMQL_GOVERNOR_SETTING
from prunewatch.records.results import FAILURE_REASONS

UID = "prunewatch-engine"

TARGET_DOMAIN = 'target=~"$target", domain=~"$domain"'
"""Label matchers of the governor's series: they carry target and domain (not model)."""


def build_engine_detail(settings: DashboardSettings) -> Json:
    ds = Datasources.from_settings(settings)
    p = ds.prometheus
    layout = Layout()
    layout.add(row("Latency"))
    layout.add(timeseries(
        "Latency breakdown per probe (measured mean)",
        "Mean seconds per probe of each phase, from the collector's histograms (sum rate ÷ count rate): "
        "preprocessing = tokenize + prompt features + bypass plan; inference = prefill + decode; "
        "postprocessing = detokenize + stats; quality check = scoring the served answer with the dense "
        "reference (probes only). Means add up to the mean probe time.",
        p, [prom(ref, expr, phase) for ref, (phase, expr) in zip("ABCD", promql.PHASE_MEANS.items())],
        unit="s", width=12, bars=True, stacked=True))
    layout.add(timeseries(
        "Inference latency p50 / p99 (estimated from histogram buckets)",
        "Quantiles of prefill + decode time per request over 5 minutes, interpolated by histogram_quantile within "
        "the collector's buckets (0.1 s to 5 s); the p99 is the recorded series an optional per-request SLO "
        "(LatencySLOBreached, PRUNEWATCH_RULE_LATENCY_SLO_S) evaluates. A time per request moves with answer "
        "length: the per-token panel beside it is what the default latency alerts read.",
        p, [prom("A", promql.INFERENCE_P50, "p50 · {{domain}}"), prom("B", promql.inference_p99(), "p99 · {{domain}} · {{target}}")],
        unit="s", width=12))
    layout.add(timeseries(
        "Time to first token p50 / p95 (estimated from histogram buckets)",
        "Request start to first generated token (includes preprocessing and prefill), quantiles "
        "interpolated within the collector's phase buckets.",
        p, [prom("A", promql.TTFT_P50, "p50 · {{domain}}"), prom("B", promql.TTFT_P95, "p95 · {{domain}}")],
        unit="s", width=12))
    layout.add(timeseries(
        "Per-token latency, pruned ÷ dense of the same prompts (measured, paired, 95% lower bound)",
        "Pruned time per output token (phase decode) and time to first token per prompt token (first_token) over "
        "the dense run of the same prompt on the same target, run back to back in the baseline rounds (every "
        "N-th round), pooled over the pairs of the last baseline rounds: the estimate, and the lower bound of its "
        "95% interval over pairs, which is what DecodeSlowerThanDense and FirstTokenSlowerThanDense compare with "
        "the limit measured for each model (dashed; a model without one is held to the 1.5 fallback). Below 1 "
        "pruning made it faster; a lower bound of 0 means one pair, no claim. No line: no baseline round yet.",
        p, [prom("A", promql.latency_vs_dense("estimate"), "{{phase}} · {{domain}} · {{target}}"),
            prom("B", promql.latency_vs_dense("low"), "{{phase}} lower bound · {{domain}} · {{target}}"),
            prom("C", promql.thresholds("tpot_vs_dense_max", "ttft_vs_dense_max"),
                 "threshold {{kind}} · {{model}} ({{source}})")],
        unit="none", width=12, minimum=0, overrides=[DASHED_THRESHOLDS]))
    layout.add(timeseries(
        "Tokens per second (measured, last probe)",
        "Completion tokens ÷ inference time of each domain's last probe, batch 1.",
        p, [prom("A", promql.TOKENS_PER_SECOND, "{{domain}} · {{model}}")], unit="none", width=12, minimum=0))
    layout.add(timeseries(
        "Probe wall time by target (measured mean)",
        "Mean seconds per probe as the collector timed it end to end (request, generation, quality check, "
        "transfer), by target and outcome: the one latency every target has, remote baselines included.",
        p, [prom("A", promql.PROBE_WALL_TIME, "{{target}} · {{status}}")], unit="s", width=24, height=7))
    layout.add(timeseries(
        "Pruning ratio by phase (measured, last probe)",
        "Share of dense linear-layer FLOPs not executed, counted apart for the prompt's forward pass "
        "(prefill: many rows, compute-bound; long prompts run dense there) and for the decode steps (one "
        "row each, memory-bound: where skipped work turns into time). The request ratio the alerts read "
        "weighs both by their FLOPs.",
        p, [prom(ref, expr, f"{phase} · {{{{domain}}}}") for ref, (phase, expr) in zip("AB", promql.PHASE_RATIOS.items())],
        unit="percentunit", width=24, height=7, minimum=0, maximum=1))
    layout.add(row("Serving under load (prunewatch serve's batcher)"))
    layout.add(timeseries(
        "Stepper time by activity (measured share)",
        "Where the batcher's stepper thread, which runs every forward pass of `prunewatch serve`, spent its time: "
        "decode (batched steps shared by every request whose next token is due), packed (prefill chunks with the "
        "due decode rows riding along in the same pass), jobs (prefill chunks with no row due and quality passes, "
        "run alone between steps), gather (waiting for the other requests' next rows) and idle, from "
        "prunewatch_batcher_seconds_total. A growing packed share is prefill taking the cores from decoding; a "
        "growing jobs share under load is work stalling the requests already decoding.",
        p, [prom("A", promql.STEPPER_SHARE, "{{activity}} · {{model}}")],
        unit="percentunit", width=12, bars=True, stacked=True, minimum=0, maximum=1))
    layout.add(timeseries(
        "Decode step time by rows in the step (measured mean)",
        "Mean wall time of a batched decode step of b rows (step seconds over steps, by rows): a step reads each "
        "weight once for all its rows, so the time per token is this over b. Steps of more than one row run dense "
        "(the union of the rows' active channels leaves little to skip).",
        p, [prom("A", promql.DECODE_STEP_SECONDS_BY_ROWS, "{{rows}} rows · {{model}}")],
        unit="s", width=12, minimum=0))
    layout.add(timeseries(
        "Decode steps per second by rows in the step (measured)",
        "How many rows the served requests shared their steps with: steps per second of each size, stacked.",
        p, [prom("A", promql.DECODE_STEPS_BY_ROWS, "{{rows}} rows · {{model}}")],
        unit="none", width=12, bars=True, stacked=True, minimum=0))
    layout.add(timeseries(
        "KV cache reserved by decoding requests (measured) against its budget (configured)",
        "Bytes of KV cache the requests decoding together have reserved (each its prompt plus max_tokens at "
        "every layer), and the budget admission keeps them under (PRUNEWATCH_SERVER_KV_CACHE_MIB, dashed): a "
        "request that does not fit waits for room.",
        p, [prom("A", promql.KV_CACHE_RESERVED, "reserved · {{model}}"),
            prom("B", promql.KV_CACHE_BUDGET, "threshold budget · {{model}}")],
        unit="bytes", width=12, minimum=0, overrides=[DASHED_THRESHOLDS]))
    layout.add(row("Quality governor"))
    layout.add(timeseries(
        "Governed pruning sensitivity by target and domain (set by the governor from measured agreement)",
        "The sensitivity the quality governor holds for each target and domain: the most aggressive setting "
        "whose measured reference-scored agreement (its 95% interval over prompts) stays at or above its floor. "
        "It drops at once by a bounded step on a breach (PruningGovernorClamped) and climbs back in small "
        "steps after consecutive good evaluations. `prunewatch governor status` shows each decision's evidence.",
        p, [prom("A", promql.scoped(PROMQL_GOVERNOR_SETTING, TARGET_DOMAIN), "{{target}} · {{domain}}")],
        unit="none", width=24, height=7, minimum=0, maximum=1))
    layout.add(row("Hardware"))
    layout.add(timeseries(
        "DRAM bytes per instruction (by source)",
        "source=ncu: measured by Nsight Compute (dram__bytes_read.sum / sm__inst_executed.sum) on an NVIDIA "
        "GPU. source=estimate: model-level estimate (weight + KV bytes the executed layers read ÷ an "
        "instruction count derived from the executed FLOPs). The two are never averaged together.",
        p, [prom("A", promql.DRAM_BYTES_PER_INSTRUCTION, "{{domain}} · source={{source}}")],
        unit="decbytes", width=12))
    layout.add(timeseries(
        "Peak memory per probe (measured, from the store)",
        "Largest peak memory of a probe per domain and interval, from the probe_results table: the "
        "growth of the process's peak RSS on a CPU (0 once the high-water mark was reached earlier), "
        "torch.cuda.max_memory_allocated on a GPU.",
        ds.postgres, [pg("A", sql.PEAK_MEMORY)], unit="bytes", width=12, minimum=0))
    layout.add(row("Fallbacks and failures"))
    layout.add(timeseries(
        "Dense fallbacks by reason (measured, from the store)",
        "Probes that ran dense although a pruning sensitivity was set, counted per reason (e.g. "
        "uncalibrated: the engine had no calibration for the model).",
        ds.postgres, [pg("A", sql.FALLBACKS)], unit="none", width=8, bars=True, stacked=True, minimum=0))
    layout.add(table(
        "Probe failures by reason (counted)",
        f"Failed probes over the dashboard's time range, by domain and reason ({', '.join(FAILURE_REASONS)}), "
        "from the collector's failure counter; reasons that did not occur are left out.",
        p, [prom("A", promql.FAILURES_BY_REASON, instant=True, table=True)], width=8))
    layout.add(table(
        "Probe results by status (counted)",
        "Probe results over the dashboard's time range by status (ok / failed).",
        p, [prom("A", promql.RESULTS_BY_STATUS, instant=True, table=True)], width=8))
    return dashboard(uid=UID, title="prunewatch · engine detail",
                     description="Latency breakdown, throughput, DRAM traffic, memory and fallbacks of the probed engines.",
                     layout=layout, variables=prometheus_variables(p), settings=settings)
