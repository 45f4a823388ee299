"""Prometheus metric families of probe results: names, help, labels, buckets and the value each
result sets, declared once in RESULT_FAMILIES.

CollectorMetrics turns that table into prometheus_client families; prunewatch/alerts/_series.py rebuilds the same
series from stored results by reading the same table; the server's live-traffic metrics record the
same families. The PromQL of the figures derived from them lives next door in prunewatch/records/promql.py.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass
from typing import Literal

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from prunewatch.records.latency_window import (
    PHASES,
    LatencyWindow,
    LatencyWindows,
    time_per_output_token_s,
    ttft_per_prompt_token_s,
)
from prunewatch.records.operating_range import Threshold
from prunewatch.records.quality_window import AnswerWindow, QualityWindows
from prunewatch.records.results import FAILURE_REASONS, ProbeResult

LATENCY_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1.2, 2.0, 5.0)
PHASE_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.2, 2.0, 5.0)
# Whole probes as the collector sees them: a CPU probe with its quality check takes seconds, a
# timed-out one up to the target's timeout.
PROBE_DURATION_BUCKETS = (0.1, 0.3, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0)
# Time to first token as the collector sees it: network and queueing included, a CPU engine's prefill too.
CLIENT_TTFT_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0)


def check_metric_name(name: str) -> str:
    """Fail at construction, not at scrape time, on a name Prometheus or our conventions reject."""
    if not re.fullmatch(r"prunewatch_[a-z0-9_]+", name):
        raise ValueError(f"metric name {name!r} must be snake_case and start with prunewatch_")
    return name


LABEL_VALUES: dict[str, Callable[[ProbeResult], str]] = {
    "model": lambda r: r.model,
    "domain": lambda r: r.domain,
    "target": lambda r: r.target,
    "probe": lambda r: r.probe_id,
    "status": lambda r: r.status,
    "reason": lambda r: r.failure_reason or "exception",
    "source": lambda r: r.dram_source or "estimate",
}
"""Label name -> its value for one result: every family spells a label the same way."""


def _seconds(milliseconds: float | None) -> float | None:
    return None if milliseconds is None else milliseconds / 1000.0


@dataclass(frozen=True)
class ResultFamily:
    """One metric family fed by probe results: what it is called and what each result does to it."""

    name: str  # as registered; a counter is exposed with `_total` appended
    kind: Literal["gauge", "counter", "histogram"]
    documentation: str
    labels: tuple[str, ...]
    value: Callable[[ProbeResult], float | None]  # the gauge value / counter increment / observation; None: nothing
    buckets: tuple[float, ...] = ()
    ok_only: bool = True  # failed results leave the family alone
    per_probe: bool = False  # bookkeeping of the prober (results, failures, wall time, last success): no live traffic
    runs: Literal["pruned", "baseline", "any"] = "pruned"  # which runs feed it: dense baselines have their own
    # A counter's values of its `reason` label that exist at 0 from the first result of their other labels: a
    # counter series born at 1 has no earlier sample, so rate() and increase() would not see its first increment.
    preset_reasons: tuple[str, ...] = ()

    def applies_to(self, result: ProbeResult, *, live: bool = False) -> bool:
        """Whether `result` feeds this family at all (its value may still be absent)."""
        if (self.ok_only and not result.ok) or (live and self.per_probe):
            return False
        return self.runs == "any" or (self.runs == "baseline") == result.baseline

    @property
    def exposed(self) -> str:
        return f"{self.name}_total" if self.kind == "counter" else self.name

    def label_values(self, result: ProbeResult) -> tuple[str, ...]:
        return tuple(LABEL_VALUES[label](result) for label in self.labels)


_PROBE = ("model", "domain", "probe", "target")
_DOMAIN = ("model", "domain", "target")

RESULT_FAMILIES: tuple[ResultFamily, ...] = (
    ResultFamily("prunewatch_pruning_ratio", "gauge",
                 "Measured share of dense linear-layer FLOPs not executed, last probe (0..1).",
                 _PROBE, lambda r: r.pruning_ratio),  # absent (a baseline server) is not zero
    ResultFamily("prunewatch_prefill_pruning_ratio", "gauge",
                 "Measured pruning ratio of the prompt's forward pass alone, last probe (0..1).",
                 _PROBE, lambda r: r.prefill_pruning_ratio),
    ResultFamily("prunewatch_decode_pruning_ratio", "gauge",
                 "Measured pruning ratio of the decode steps alone, last probe (0..1): where skipping saves time.",
                 _PROBE, lambda r: r.decode_pruning_ratio),
    ResultFamily("prunewatch_inference_latency_seconds", "histogram", "Prefill + decode wall time of a probe.",
                 _DOMAIN, lambda r: _seconds(r.inference_ms), LATENCY_BUCKETS),
    ResultFamily("prunewatch_tokens_per_second", "gauge", "Completion tokens / inference time of the last probe.",
                 _DOMAIN, lambda r: r.tokens_per_s),
    ResultFamily("prunewatch_probe_failures", "counter", "Probes that failed, by reason.",
                 ("model", "domain", "reason", "target"), lambda r: None if r.ok else 1.0,
                 ok_only=False, per_probe=True, runs="any", preset_reasons=FAILURE_REASONS),
    ResultFamily("prunewatch_probe_results", "counter", "Probe results recorded, by status.",
                 ("model", "domain", "status", "target"), lambda r: 1.0, ok_only=False, per_probe=True, runs="any"),
    ResultFamily("prunewatch_preprocessing_latency_seconds", "histogram", "Tokenize + plan time of a probe.",
                 _DOMAIN, lambda r: _seconds(r.preprocessing_ms), PHASE_BUCKETS),
    ResultFamily("prunewatch_postprocessing_latency_seconds", "histogram", "Detokenize + stats time of a probe.",
                 _DOMAIN, lambda r: _seconds(r.postprocessing_ms), PHASE_BUCKETS),
    ResultFamily("prunewatch_quality_check_latency_seconds", "histogram",
                 "Time of a probe's quality check: scoring the served answer (and a dense re-run in a full check).",
                 _DOMAIN, lambda r: _seconds(r.quality_ms), PROBE_DURATION_BUCKETS),
    ResultFamily("prunewatch_time_to_first_token_seconds", "histogram", "Request start to first generated token.",
                 _DOMAIN, lambda r: _seconds(r.ttft_ms), PHASE_BUCKETS),
    ResultFamily("prunewatch_reference_agreement", "gauge",
                 "Share of the served answer's tokens equal to a dense reference's argmax given the served prefix, "
                 "last probe (0..1).",
                 _PROBE, lambda r: r.reference_agreement),
    ResultFamily("prunewatch_continuation_agreement", "gauge",
                 "Pruned model's argmax agreement, teacher-forced on the dense model's own continuation, last probe "
                 "(a full check of a prunewatch engine only; more forgiving than the reference agreement).",
                 _PROBE, lambda r: r.continuation_agreement),
    ResultFamily("prunewatch_dram_bytes_per_instruction", "gauge",
                 "DRAM bytes per instruction; source=ncu (measured) or estimate (model-level).",
                 ("model", "domain", "source", "target"), lambda r: r.dram_bytes_per_instruction),
    ResultFamily("prunewatch_last_success_timestamp_seconds", "gauge",
                 "Unix time of the last successful probe per target.", ("model", "target"),
                 lambda r: r.created_at.timestamp(), per_probe=True, runs="any"),
    ResultFamily("prunewatch_probe_duration_seconds", "histogram",
                 "Wall time of a whole probe as the collector measured it (any target, baselines included).",
                 ("model", "target", "status"), lambda r: _seconds(r.duration_ms), PROBE_DURATION_BUCKETS,
                 ok_only=False, per_probe=True, runs="any"),
    ResultFamily("prunewatch_client_time_to_first_token_seconds", "histogram",
                 "Probe sent to first content token received, timed by the collector on the stream "
                 "(network and queueing included; HTTP targets).",
                 _DOMAIN, lambda r: _seconds(r.client_ttft_ms), CLIENT_TTFT_BUCKETS, per_probe=True),
    ResultFamily("prunewatch_client_decode_tokens_per_second", "gauge",
                 "Completion tokens after the first / time from first to last token, timed by the collector on the "
                 "stream (network included; HTTP targets), last probe.",
                 _DOMAIN, lambda r: r.client_decode_tokens_per_s, per_probe=True),
    ResultFamily("prunewatch_dense_inference_latency_seconds", "histogram",
                 "Prefill + decode wall time of a dense baseline run (sensitivity 0) on the same target, "
                 "as the engine measured it.",
                 _DOMAIN, lambda r: _seconds(r.inference_ms), LATENCY_BUCKETS, per_probe=True, runs="baseline"),
    ResultFamily("prunewatch_dense_client_time_to_first_token_seconds", "histogram",
                 "Time to first token of a dense baseline run, timed by the collector (network included).",
                 _DOMAIN, lambda r: _seconds(r.client_ttft_ms), CLIENT_TTFT_BUCKETS, per_probe=True,
                 runs="baseline"),
    # Per token, so a comparison with dense does not depend on how long an answer was (the latency rules).
    ResultFamily("prunewatch_time_per_output_token_seconds", "gauge",
                 "Decode seconds per output token after the first (engine-measured; the collector's stream timing "
                 "for targets that report none), last probe.",
                 _PROBE, time_per_output_token_s, per_probe=True),
    ResultFamily("prunewatch_dense_time_per_output_token_seconds", "gauge",
                 "The same for the dense baseline run (sensitivity 0) of the probe on the same target.",
                 _PROBE, time_per_output_token_s, per_probe=True, runs="baseline"),
    ResultFamily("prunewatch_time_to_first_token_per_prompt_token_seconds", "gauge",
                 "Time to first token over the prompt's tokens (engine-measured, else the collector's), last probe.",
                 _PROBE, ttft_per_prompt_token_s, per_probe=True),
    ResultFamily("prunewatch_dense_time_to_first_token_per_prompt_token_seconds", "gauge",
                 "The same for the dense baseline run of the probe on the same target.",
                 _PROBE, ttft_per_prompt_token_s, per_probe=True, runs="baseline"),
)
"""Every family a probe result feeds, in one table (names checked when CollectorMetrics is built)."""

QUALITY_AGREEMENT = "prunewatch_reference_agreement_window"
QUALITY_PROMPTS = "prunewatch_reference_agreement_prompts"
TASK_PASS_RATE = "prunewatch_task_pass_rate_window"
BOUNDS = ("estimate", "low", "high")
WINDOW_LABELS = ("model", "domain", "target", "bound")
QUALITY_WINDOW_FAMILIES = {
    QUALITY_AGREEMENT: "Reference-scored agreement pooled over the prompts a target answered at its current "
                       "sensitivity in its last rounds (records/quality_window.py), bound=estimate, and the 95% "
                       "interval bootstrapped over prompts, bound=low / high.",
    TASK_PASS_RATE: "Share of checked prompts whose newest answer passed the probe's check, over the same window; "
                    "bound=estimate / low / high as for the agreement.",
}
"""Gauges derived from a window of results rather than from one (set by CollectorMetrics, replayed by the
embedded evaluator the same way)."""

LATENCY_VS_DENSE = "prunewatch_latency_vs_dense_window"
LATENCY_PAIRS = "prunewatch_latency_vs_dense_pairs"
LATENCY_WINDOW_LABELS = ("model", "domain", "target", "phase", "bound")
LATENCY_WINDOW_FAMILIES = {
    LATENCY_VS_DENSE: "Pruned over dense time per token of the same prompts, run back to back in the last baseline "
                      "rounds (records/latency_window.py): phase=decode (per output token) or first_token (time to "
                      "first token per prompt token); bound=estimate, and the 95% interval bootstrapped over "
                      "prompt pairs, bound=low / high.",
    LATENCY_PAIRS: "Prompt pairs (pruned and dense) behind prunewatch_latency_vs_dense_window.",
}
"""Gauges of the paired latency window, set by CollectorMetrics and replayed by the embedded evaluator."""

ALERT_THRESHOLD = "prunewatch_alert_threshold"
ALERT_THRESHOLD_LABELS = ("model", "kind", "source")
"""A watched model's alert thresholds, measured for it (records/operating_range.py): kind = ratio_low,
ratio_red_line, ratio_risk, quality_floor, tpot_vs_dense_max, ttft_vs_dense_max; source = calibration or tune.
The rules compare with them `on(model)`; a model without them falls back to the rule file's defaults."""


def window_samples(window: AnswerWindow) -> dict[str, dict[str, float]]:
    """The window gauges' values for one (target, model, domain): family -> bound -> value; prompts apart."""
    out: dict[str, dict[str, float]] = {}
    for family, interval in ((QUALITY_AGREEMENT, window.agreement()), (TASK_PASS_RATE, window.pass_rate())):
        if interval is not None:
            out[family] = {"estimate": interval.estimate, "low": interval.low, "high": interval.high}
            if family == QUALITY_AGREEMENT:
                out[QUALITY_PROMPTS] = {"": float(interval.prompts)}
    return out


def latency_samples(window: LatencyWindow) -> dict[str, dict[tuple[str, ...], float]]:
    """The latency window gauges' values for one (target, model, domain): family -> (phase[, bound]) -> value."""
    out: dict[str, dict[tuple[str, ...], float]] = {LATENCY_VS_DENSE: {}, LATENCY_PAIRS: {}}
    for phase in PHASES:
        interval = window.ratio(phase)
        if interval is None:
            continue
        for bound in BOUNDS:
            out[LATENCY_VS_DENSE][(phase, bound)] = getattr(interval, bound)
        out[LATENCY_PAIRS][(phase,)] = float(interval.prompts)
    return out


class CollectorMetrics:
    """The collector's metric families (RESULT_FAMILIES), registered in the given registry."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self._versions = itertools.count(1)  # next() is atomic: concurrent records never share a version
        self._version = 0
        self._depth: Callable[[], float] | None = None
        self.families: dict[str, Gauge | Counter | Histogram] = {
            family.name: _build(family, self.registry) for family in RESULT_FAMILIES}
        self.windows = QualityWindows()
        self.window_gauges = {name: Gauge(check_metric_name(name), text, list(WINDOW_LABELS), registry=self.registry)
                              for name, text in QUALITY_WINDOW_FAMILIES.items()}
        self.window_gauges[QUALITY_PROMPTS] = Gauge(
            check_metric_name(QUALITY_PROMPTS), "Prompts behind prunewatch_reference_agreement_window.",
            ["model", "domain", "target"], registry=self.registry)
        self.latency_windows = LatencyWindows()
        self.latency_gauges = {
            name: Gauge(check_metric_name(name), text,
                        list(LATENCY_WINDOW_LABELS if name == LATENCY_VS_DENSE else LATENCY_WINDOW_LABELS[:-1]),
                        registry=self.registry)
            for name, text in LATENCY_WINDOW_FAMILIES.items()}
        self.thresholds = Gauge(check_metric_name(ALERT_THRESHOLD),
                                "Alert threshold measured for a model (kind), with how it was obtained (source).",
                                list(ALERT_THRESHOLD_LABELS), registry=self.registry)
        self._preset: set[tuple[str, tuple[str, ...]]] = set()  # (family, label values) whose reasons exist
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

    def set_thresholds(self, thresholds: Iterable[Threshold]) -> None:
        """Export these models' measured alert thresholds (the series of other models stay as they are)."""
        for t in thresholds:
            self.thresholds.labels(t.model, t.kind, t.source).set(t.value)
        self.changed()

    def count_store_error(self, kind: str) -> None:
        if self.store_write_errors is not None:
            self.store_write_errors.labels(kind).inc()
            self.changed()

    def count_dropped(self, results: int) -> None:
        if self.buffer_dropped is not None and results > 0:
            self.buffer_dropped.inc(results)
            self.changed()

    def changed(self) -> None:
        """Bump the state key: a sample this class does not own (e.g. the governor's) moved, re-render /metrics."""
        self._version = next(self._versions)

    def state_key(self) -> Hashable:
        """Changes whenever an exposed sample may have changed; read it *before* rendering.

        Every sample of this class moves through `record` or the buffer methods, which bump the
        version after updating; the buffer depth is read live. So a render cached under this key
        is current as long as the key is (see prunewatch/collector/exposition.py).
        """
        return self._version, (self._depth() if self._depth is not None else None)

    def record(self, result: ProbeResult, *, live: bool = False) -> None:
        """Exporter entry point: turn one result into samples.

        `live` is a served request rather than a probe: the prober's bookkeeping families stay as they are.
        """
        try:
            for family in RESULT_FAMILIES:
                if not family.applies_to(result, live=live):
                    continue
                if family.preset_reasons:
                    self._preset_reasons(family, family.label_values(result))
                value = family.value(result)
                if value is None:
                    continue
                metric = self.families[family.name].labels(*family.label_values(result))
                if isinstance(metric, Gauge):  # the family's kind decided the class (_build)
                    metric.set(value)
                elif isinstance(metric, Counter):
                    metric.inc(value)
                else:
                    metric.observe(value)
            if not live:
                self._record_window(result)
                self._record_latency_window(result)
        finally:
            self.changed()

    def _record_window(self, result: ProbeResult) -> None:
        window = self.windows.add(result)
        if window is None:
            return
        for family, values in window_samples(window).items():
            for bound, value in values.items():
                labels = (result.model, result.domain, result.target) + ((bound,) if bound else ())
                self.window_gauges[family].labels(*labels).set(value)

    def _record_latency_window(self, result: ProbeResult) -> None:
        window = self.latency_windows.add(result)
        if window is None:
            return
        for family, values in latency_samples(window).items():
            for key, value in values.items():
                self.latency_gauges[family].labels(result.model, result.domain, result.target, *key).set(value)

    def _preset_reasons(self, family: ResultFamily, values: tuple[str, ...]) -> None:
        """Create the family's series for every preset reason at 0, once per set of its other labels."""
        at = family.labels.index("reason")
        key = (family.name, values[:at] + values[at + 1:])
        if key in self._preset:
            return
        self._preset.add(key)
        for reason in family.preset_reasons:
            self.families[family.name].labels(*values[:at], reason, *values[at + 1:])


def _build(family: ResultFamily, registry: CollectorRegistry) -> Gauge | Counter | Histogram:
    name, labels = check_metric_name(family.name), list(family.labels)
    if family.kind == "gauge":
        return Gauge(name, family.documentation, labels, registry=registry)
    if family.kind == "counter":
        return Counter(name, family.documentation, labels, registry=registry)
    return Histogram(name, family.documentation, labels, buckets=family.buckets, registry=registry)
