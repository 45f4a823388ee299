"""Live-traffic metrics of the HTTP API.

The per-request families are the collector's own (`prunewatch.records.metrics.CollectorMetrics`): same
names, help, labels and buckets, so a dashboard or alert rule written for probe results reads live
traffic too; live requests carry `probe="live"` where the collector's families have a probe label.
This module adds what only a server has: request counters by endpoint and status, the admission
queue, token and FLOP counters.

The engine fills `RequestStats`; `record_generation` is the exporter that turns one into samples.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from prunewatch.engine.batching import StepperTime
from prunewatch.engine.stats import RequestStats
from prunewatch.probes import Probe
from prunewatch.records.engine_stats import probe_result_from_stats
from prunewatch.records.metrics import LATENCY_BUCKETS, CollectorMetrics, check_metric_name

LIVE_PROBE = "live"
SELF_TARGET = ""  # the collector's `target` label names a probed engine; an engine's own traffic has none
NO_DOMAIN = "none"  # requests that ran dense (sensitivity 0, or no calibration): no domain matched

class StepperTimeCollector(Collector):
    """The batcher's stepper time (prunewatch.engine.batching.StepperTime) as counters, read at each scrape:
    rate(prunewatch_batcher_seconds_total[1m]) by activity says where the cores went, and the step seconds over
    the steps by rows what a decode step of that many rows costs."""

    def __init__(self, model: str, read: Callable[[], StepperTime]) -> None:
        self.model, self.read = model, read

    def collect(self) -> Iterator[CounterMetricFamily]:
        t = self.read()
        seconds = CounterMetricFamily(
            check_metric_name("prunewatch_batcher_seconds"),
            "Wall time of the batcher's stepper by activity: decode (batched steps), packed (prefill chunks with "
            "the due decode rows riding along), jobs (prefill chunks with no row due and quality passes, run "
            "alone), gather (rows due, waiting for the other decoding requests' rows), idle.",
            labels=["model", "activity"])
        for activity, value in t.seconds_by_activity().items():
            seconds.add_metric([self.model, activity], value)
        steps = CounterMetricFamily(check_metric_name("prunewatch_decode_steps"),
                                    "Batched decode steps run, by rows in the step.", labels=["model", "rows"])
        step_seconds = CounterMetricFamily(check_metric_name("prunewatch_decode_step_seconds"),
                                           "Wall time of the batched decode steps, by rows in the step.",
                                           labels=["model", "rows"])
        for rows in sorted(t.steps_by_rows):
            steps.add_metric([self.model, str(rows)], t.steps_by_rows[rows])
            step_seconds.add_metric([self.model, str(rows)], t.step_s_by_rows.get(rows, 0.0))
        packed = CounterMetricFamily(check_metric_name("prunewatch_packed_passes"),
                                     "Prefill chunks run in one pass with the due decode rows riding along.",
                                     labels=["model"])
        packed.add_metric([self.model], t.packed)
        packed_rows = CounterMetricFamily(check_metric_name("prunewatch_packed_rows"),
                                          "Decode rows the packed passes took along (one token each).",
                                          labels=["model"])
        packed_rows.add_metric([self.model], t.packed_rows)
        yield from (seconds, steps, step_seconds, packed, packed_rows)


class ServerMetrics:
    """Metric families of one server, registered in the given registry (a fresh one per test)."""

    def __init__(self, model: str, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.model = model
        r = self.registry
        self.shared = CollectorMetrics(registry=r)
        self.requests = Counter(
            check_metric_name("prunewatch_requests"),
            "HTTP requests answered, by endpoint and status code.", ["model", "endpoint", "status"], registry=r)
        self.request_duration = Histogram(
            check_metric_name("prunewatch_request_duration_seconds"),
            "Wall time of an HTTP request, queueing included, until its last byte.", ["model", "endpoint"],
            buckets=LATENCY_BUCKETS, registry=r)
        self.in_queue = Gauge(
            check_metric_name("prunewatch_requests_in_queue"),
            "Requests admitted and not finished (waiting plus running).", ["model"], registry=r)
        self.queue_depth = Gauge(
            check_metric_name("prunewatch_queue_depth_limit"),
            "Configured admission limit; requests beyond it get 429.", ["model"], registry=r)
        self.prompt_tokens = Counter(
            check_metric_name("prunewatch_prompt_tokens"), "Prompt tokens of served requests.", ["model"], registry=r)
        self.cached_prompt_tokens = Counter(
            check_metric_name("prunewatch_prompt_tokens_cached"),
            "Prompt tokens whose keys and values came from the prefix cache (a head computed before).", ["model"],
            registry=r)
        self.completion_tokens = Counter(
            check_metric_name("prunewatch_completion_tokens"), "Completion tokens generated.", ["model"], registry=r)
        self.executed_flops = Counter(
            check_metric_name("prunewatch_executed_flops"),
            "Linear-layer FLOPs that really executed (the pruning ratio's numerator side).",
            ["model", "domain"], registry=r)
        self.dense_flops = Counter(
            check_metric_name("prunewatch_dense_flops"),
            "Linear-layer FLOPs the dense model would have executed for the same tokens.",
            ["model", "domain"], registry=r)
        self.decode_batch_size = Histogram(
            check_metric_name("prunewatch_decode_batch_size"),
            "Rows per decode step a generation ran in, on average over its steps (1: alone).", ["model"],
            buckets=(1, 1.5, 2, 3, 4, 6, 8, 12, 16, 32, 64), registry=r)
        self.kv_cache_reserved = Gauge(
            check_metric_name("prunewatch_kv_cache_reserved_bytes"),
            "KV cache reserved by the requests decoding together (prompt plus max tokens each).", ["model"],
            registry=r)
        self.kv_cache_budget = Gauge(
            check_metric_name("prunewatch_kv_cache_budget_bytes"),
            "Configured KV cache budget of the batched requests; a request waits for room beyond it.", ["model"],
            registry=r)
        self.prefix_cache_bytes = Gauge(
            check_metric_name("prunewatch_prefix_cache_bytes"),
            "Keys and values the prefix cache holds for stored chat-prompt heads.", ["model"], registry=r)
        self.prefix_cache_entries = Gauge(
            check_metric_name("prunewatch_prefix_cache_entries"),
            "Chat-prompt heads the prefix cache holds.", ["model"], registry=r)
        self.prefix_cache_budget = Gauge(
            check_metric_name("prunewatch_prefix_cache_budget_bytes"),
            "Configured memory bound of the prefix cache (PRUNEWATCH_ENGINE_PREFIX_CACHE_MIB).", ["model"], registry=r)
        self._in_queue = self.in_queue.labels(model)

    def watch_kv_cache(self, reserved: Callable[[], float], budget_bytes: int) -> None:
        """Publish the batcher's KV reservation (read at each scrape) and its budget."""
        self.kv_cache_reserved.labels(self.model).set_function(reserved)
        self.kv_cache_budget.labels(self.model).set(budget_bytes)

    def watch_prefix_cache(self, held_bytes: Callable[[], float], entries: Callable[[], float],
                           budget_bytes: int | None) -> None:
        """Publish the prefix cache's size (read at each scrape) and its memory bound (None: bounded by count only)."""
        self.prefix_cache_bytes.labels(self.model).set_function(held_bytes)
        self.prefix_cache_entries.labels(self.model).set_function(entries)
        if budget_bytes is not None:
            self.prefix_cache_budget.labels(self.model).set(budget_bytes)

    def watch_stepper(self, read: Callable[[], StepperTime]) -> None:
        """Publish the batcher's stepper time (read at each scrape)."""
        self.registry.register(StepperTimeCollector(self.model, read))

    def set_queue_limit(self, depth: int) -> None:
        self.queue_depth.labels(self.model).set(depth)

    def set_in_queue(self, count: int) -> None:
        self._in_queue.set(count)

    def record_request(self, endpoint: str, status: int, seconds: float) -> None:
        self.requests.labels(self.model, endpoint, str(status)).inc()
        self.request_duration.labels(self.model, endpoint).observe(seconds)

    def record_generation(self, stats: RequestStats) -> None:
        """One finished generation as samples of the shared families. Dense requests do not move the ratio gauges.

        The request becomes a result of the pseudo-probe "live" (prunewatch.records.engine_stats maps the stats by
        name, as for a probe) and goes through the same table as every probe result. A request with no
        matched domain (sensitivity 0, or no calibration) would set a 0 ratio under domain="none" and trip
        the collector's ratio-low alert on a series no one prunes; it still counts in the FLOP counters,
        so the traffic-weighted ratio includes it.
        """
        model, domain = self.model, stats.domain or NO_DOMAIN
        self.prompt_tokens.labels(model).inc(stats.prompt_tokens)
        self.cached_prompt_tokens.labels(model).inc(stats.cached_prompt_tokens)
        self.completion_tokens.labels(model).inc(stats.completion_tokens)
        self.decode_batch_size.labels(model).observe(stats.mean_batch_size)
        self.executed_flops.labels(model, domain).inc(stats.executed_flops)
        self.dense_flops.labels(model, domain).inc(stats.dense_flops)
        live = Probe(id=LIVE_PROBE, domain=domain, version=0, max_tokens=stats.completion_tokens, system="", prompt="")
        result = probe_result_from_stats(target=SELF_TARGET, probe=live, round_id=LIVE_PROBE, stats=stats, text="",
                                         duration_ms=stats.inference_ms)
        if stats.domain is None:
            result.pruning_ratio = result.prefill_pruning_ratio = result.decode_pruning_ratio = None
        result.model = model
        self.shared.record(result, live=True)
