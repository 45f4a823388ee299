"""Prometheus metric families of probe results: names, help, labels and buckets, defined once.

The PromQL of the figures derived from them lives next door in records/promql.py; the server's live
traffic metrics (server/metrics.py) reuse these families so one query reads both.
"""

from __future__ import annotations

import itertools
import re
from typing import Callable, Hashable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from records.results import ProbeResult

LATENCY_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1.2, 2.0, 5.0)
PHASE_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.2, 2.0, 5.0)
# Whole probes as the collector sees them: a CPU probe with its quality check takes seconds, a
# timed-out one up to the target's timeout.
PROBE_DURATION_BUCKETS = (0.1, 0.3, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0)

def check_metric_name(name: str) -> str:
    """Fail at construction, not at scrape time, on a name Prometheus or our conventions reject."""
    if not re.fullmatch(r"prunewatch_[a-z0-9_]+", name):
        raise ValueError(f"metric name {name!r} must be snake_case and start with prunewatch_")
    return name


class CollectorMetrics:
    """The collector's metric families, registered in the given registry."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self._versions = itertools.count(1)  # next() is atomic: concurrent records never share a version
        self._version = 0
        self._depth: Callable[[], float] | None = None
        r = self.registry
        self.pruning_ratio = Gauge(
            check_metric_name("prunewatch_pruning_ratio"),
            "Measured share of dense linear-layer FLOPs not executed, last probe (0..1).",
            ["model", "domain", "probe", "target"], registry=r)
        self.prefill_pruning_ratio = Gauge(
            check_metric_name("prunewatch_prefill_pruning_ratio"),
            "Measured pruning ratio of the prompt's forward pass alone, last probe (0..1).",
            ["model", "domain", "probe", "target"], registry=r)
        self.decode_pruning_ratio = Gauge(
            check_metric_name("prunewatch_decode_pruning_ratio"),
            "Measured pruning ratio of the decode steps alone, last probe (0..1): where skipping saves time.",
            ["model", "domain", "probe", "target"], registry=r)
        self.inference_latency = Histogram(
            check_metric_name("prunewatch_inference_latency_seconds"),
            "Prefill + decode wall time of a probe.", ["model", "domain", "target"], buckets=LATENCY_BUCKETS, registry=r)
        self.tokens_per_second = Gauge(
            check_metric_name("prunewatch_tokens_per_second"),
            "Completion tokens / inference time of the last probe.", ["model", "domain", "target"], registry=r)
        self.probe_failures = Counter(
            check_metric_name("prunewatch_probe_failures"),
            "Probes that failed, by reason.", ["model", "domain", "reason", "target"], registry=r)
        self.probe_results = Counter(
            check_metric_name("prunewatch_probe_results"),
            "Probe results recorded, by status.", ["model", "domain", "status", "target"], registry=r)
        self.preprocessing = Histogram(
            check_metric_name("prunewatch_preprocessing_latency_seconds"),
            "Tokenize + plan time of a probe.", ["model", "domain", "target"], buckets=PHASE_BUCKETS, registry=r)
        self.postprocessing = Histogram(
            check_metric_name("prunewatch_postprocessing_latency_seconds"),
            "Detokenize + stats time of a probe.", ["model", "domain", "target"], buckets=PHASE_BUCKETS,
            registry=r)
        self.quality_check = Histogram(
            check_metric_name("prunewatch_quality_check_latency_seconds"),
            "Dense re-run + teacher-forced scoring time of a probe's quality check.", ["model", "domain", "target"],
            buckets=PROBE_DURATION_BUCKETS, registry=r)
        self.ttft = Histogram(
            check_metric_name("prunewatch_time_to_first_token_seconds"),
            "Request start to first generated token.", ["model", "domain", "target"], buckets=PHASE_BUCKETS, registry=r)
        self.token_agreement = Gauge(
            check_metric_name("prunewatch_token_agreement"),
            "Teacher-forced argmax agreement of the pruned model with the dense model, last probe.",
            ["model", "domain", "probe", "target"], registry=r)
        self.dram_bytes_per_instruction = Gauge(
            check_metric_name("prunewatch_dram_bytes_per_instruction"),
            "DRAM bytes per instruction; source=ncu (measured) or estimate (model-level).",
            ["model", "domain", "source", "target"], registry=r)
        self.last_success = Gauge(
            check_metric_name("prunewatch_last_success_timestamp_seconds"),
            "Unix time of the last successful probe per target.", ["model", "target"], registry=r)
        self.probe_duration = Histogram(
            check_metric_name("prunewatch_probe_duration_seconds"),
            "Wall time of a whole probe as the collector measured it (any target, baselines included).",
            ["model", "target", "status"], buckets=PROBE_DURATION_BUCKETS, registry=r)
        self.buffer_depth: Gauge | None = None
        self.buffer_dropped: Counter | None = None
        self.store_write_errors: Counter | None = None

    def track_buffer(self, depth: Callable[[], float]) -> None:
        """Expose the store buffer: its depth (read at scrape time), drops and failed write attempts.

        Registered only by a collector that buffers, so an engine server sharing these families
        does not show a buffer it does not have.
        """
        r = self.registry
        gauge = Gauge(check_metric_name("prunewatch_collector_buffer_depth"),
                      "Records (results and round markers) waiting in the on-disk buffer for the store.", registry=r)
        gauge.set_function(depth)
        self._depth = depth
        self.buffer_depth = gauge
        self.buffer_dropped = Counter(
            check_metric_name("prunewatch_collector_buffer_dropped"),
            "Results dropped because the on-disk buffer was full (oldest first).", registry=r)
        self.store_write_errors = Counter(
            check_metric_name("prunewatch_collector_store_write_errors"),
            "Failed attempts to write buffered records to the store (each is retried with backoff).",
            ["kind"], registry=r)

    def count_store_error(self, kind: str) -> None:
        if self.store_write_errors is not None:
            self.store_write_errors.labels(kind).inc()
            self._changed()

    def count_dropped(self, results: int) -> None:
        if self.buffer_dropped is not None and results > 0:
            self.buffer_dropped.inc(results)
            self._changed()

    def _changed(self) -> None:
        self._version = next(self._versions)

    def state_key(self) -> Hashable:
        """Changes whenever an exposed sample may have changed; read it *before* rendering.

        Every sample of this class moves through `record` or the buffer methods, which bump the
        version after updating; the buffer depth is read live. So a render cached under this key
        is current as long as the key is (see collector/exposition.py).
        """
        return self._version, (self._depth() if self._depth is not None else None)

    def record(self, result: ProbeResult) -> None:
        """Exporter entry point: turn one result into samples."""
        try:
            self._record(result)
        finally:
            self._changed()

    def _record(self, result: ProbeResult) -> None:
        model, domain, target = result.model, result.domain, result.target
        self.probe_results.labels(model, domain, result.status, target).inc()
        if result.duration_ms is not None:
            self.probe_duration.labels(model, result.target, result.status).observe(result.duration_ms / 1000.0)
        if not result.ok:
            self.probe_failures.labels(model, domain, result.failure_reason or "exception", target).inc()
            return
        if result.pruning_ratio is not None:  # absent (a baseline server) is not zero
            self.pruning_ratio.labels(model, domain, result.probe_id, target).set(result.pruning_ratio)
        if result.prefill_pruning_ratio is not None:
            self.prefill_pruning_ratio.labels(model, domain, result.probe_id, target).set(result.prefill_pruning_ratio)
        if result.decode_pruning_ratio is not None:
            self.decode_pruning_ratio.labels(model, domain, result.probe_id, target).set(result.decode_pruning_ratio)
        if result.quality_ms is not None:
            self.quality_check.labels(model, domain, target).observe(result.quality_ms / 1000.0)
        if result.inference_ms is not None:
            self.inference_latency.labels(model, domain, target).observe(result.inference_ms / 1000.0)
        if result.tokens_per_s is not None:
            self.tokens_per_second.labels(model, domain, target).set(result.tokens_per_s)
        if result.preprocessing_ms is not None:
            self.preprocessing.labels(model, domain, target).observe(result.preprocessing_ms / 1000.0)
        if result.postprocessing_ms is not None:
            self.postprocessing.labels(model, domain, target).observe(result.postprocessing_ms / 1000.0)
        if result.ttft_ms is not None:
            self.ttft.labels(model, domain, target).observe(result.ttft_ms / 1000.0)
        if result.token_agreement is not None:
            self.token_agreement.labels(model, domain, result.probe_id, target).set(result.token_agreement)
        if result.dram_bytes_per_instruction is not None:
            self.dram_bytes_per_instruction.labels(model, domain, result.dram_source or "estimate", target).set(
                result.dram_bytes_per_instruction)
        self.last_success.labels(model, result.target).set(result.created_at.timestamp())
