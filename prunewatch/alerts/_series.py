"""The collector's metrics rebuilt as time series from stored probe results and governor decisions.

Each stored result is what `CollectorMetrics.record` saw, at its `created_at`: gauges become one
sample per result, counters and histograms become events (an increment at that instant). The
families, their labels and values are prunewatch/records/metrics.py's RESULT_FAMILIES, read here, not
restated; a test replays real results through both and compares.

The quality governor's two families (prunewatch/records/governor_metrics.py) come from its stored decisions
the same way: the setting gauge takes each decision's new setting, the clamp counter increments at
each decision that lowered it (and exists, at 0, from the key's first decision, as `track` makes it).

A watched model's measured alert thresholds (`prunewatch_alert_threshold`, records/operating_range.py) come
from its operating-range file, not from results: they are constant series, present at every instant, as the
collector exports them for as long as it runs.

What Prometheus would add on top (scrape timestamps, job/instance labels, counter resets) does
not exist here; a metric that is derived from neither (the collector's buffer depth, the engine
server's own metrics) is unknown to this source and reported as such.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from dataclasses import dataclass, field

from prometheus_client.utils import floatToGoString

from prunewatch.records.governor_metrics import GOVERNOR_CLAMPS, GOVERNOR_LABELS, GOVERNOR_SETTING
from prunewatch.records.latency_window import LatencyWindows
from prunewatch.records.metrics import (
    ALERT_THRESHOLD,
    LATENCY_PAIRS,
    LATENCY_VS_DENSE,
    QUALITY_AGREEMENT,
    QUALITY_PROMPTS,
    RESULT_FAMILIES,
    TASK_PASS_RATE,
    ResultFamily,
    latency_samples,
    window_samples,
)
from prunewatch.records.operating_range import Threshold
from prunewatch.records.quality_window import QualityWindows
from prunewatch.records.results import ProbeResult
from prunewatch.records.store.governor import GovernorDecision

Labels = tuple[tuple[str, str], ...]
"""Sorted (name, value) pairs, `__name__` included."""

NAME = "__name__"


def labels_of(**values: str) -> Labels:
    """A series' labels; an empty value is no label, as in Prometheus (an engine's own live traffic has
    target="" and groups apart from every probed target, under no target label)."""
    return tuple(sorted((name, value) for name, value in values.items() if value != ""))


@dataclass
class GaugeSeries:
    """Samples of one gauge series, sorted by time (seconds since the epoch)."""

    labels: Labels
    times: list[float] = field(default_factory=list)
    values: list[float] = field(default_factory=list)

    def last_in(self, start: float, end: float) -> float | None:
        """Value of the newest sample in [start, end], or None."""
        i = bisect.bisect_right(self.times, end) - 1
        if i >= 0 and self.times[i] >= start:
            return self.values[i]
        return None

    def window(self, start: float, end: float) -> list[float]:
        """Values of the samples in [start, end] (both ends included, as Prometheus 2.x ranges are)."""
        lo = bisect.bisect_left(self.times, start)
        hi = bisect.bisect_right(self.times, end)
        return self.values[lo:hi]


@dataclass
class ConstantSeries(GaugeSeries):
    """A gauge that holds one value at every instant (a threshold the collector keeps exporting)."""

    constant: float = 0.0

    def last_in(self, start: float, end: float) -> float | None:
        return self.constant

    def window(self, start: float, end: float) -> list[float]:
        return [self.constant]


def threshold_series(thresholds: Iterable[Threshold]) -> list[GaugeSeries]:
    """`prunewatch_alert_threshold{model, kind, source}` of these thresholds, as the collector exports them."""
    return [ConstantSeries(labels_of(**{NAME: ALERT_THRESHOLD}, model=t.model, kind=t.kind, source=t.source),
                           constant=float(t.value)) for t in thresholds]


@dataclass
class CounterSeries:
    """Increments of one counter series at the instants they happened, sorted by time."""

    labels: Labels
    times: list[float] = field(default_factory=list)
    increments: list[float] = field(default_factory=list)
    _prefix: list[float] | None = field(default=None, repr=False)

    def exists_at(self, at: float) -> bool:
        return bool(self.times) and self.times[0] <= at

    def increase(self, start: float, end: float) -> float:
        """Sum of increments in (start, end]: the sample at a range's start is the baseline, as in rate()."""
        if self._prefix is None:
            self._prefix = [0.0]
            for inc in self.increments:
                self._prefix.append(self._prefix[-1] + inc)
        lo = bisect.bisect_right(self.times, start)
        hi = bisect.bisect_right(self.times, end)
        return self._prefix[hi] - self._prefix[lo]

    def any_in(self, start: float, end: float) -> bool:
        """Whether an increment happened in [start, end]."""
        lo = bisect.bisect_left(self.times, start)
        return lo < len(self.times) and self.times[lo] <= end


GAUGES: dict[str, ResultFamily] = {f.exposed: f for f in RESULT_FAMILIES if f.kind == "gauge"}
"""Gauge families of CollectorMetrics by exposed name: the value each result sets."""
HISTOGRAMS: dict[str, ResultFamily] = {f.exposed: f for f in RESULT_FAMILIES if f.kind == "histogram"}
"""Histogram families of CollectorMetrics by exposed name: the observation each result makes, in seconds."""
COUNTERS: dict[str, ResultFamily] = {f.exposed: f for f in RESULT_FAMILIES if f.kind == "counter"}
"""Counter families of CollectorMetrics by exposed name (`_total`): the increment each result makes."""


WINDOW_GAUGES = (QUALITY_AGREEMENT, QUALITY_PROMPTS, TASK_PASS_RATE, LATENCY_VS_DENSE, LATENCY_PAIRS)
"""Gauges of a window of results (records/quality_window.py, records/latency_window.py), replayed in result
order."""

GOVERNOR_CLAMPS_TOTAL = f"{GOVERNOR_CLAMPS}_total"


def counter_names() -> set[str]:
    names = set(COUNTERS) | {GOVERNOR_CLAMPS_TOTAL}
    for family in HISTOGRAMS:
        names.update({f"{family}_bucket", f"{family}_count", f"{family}_sum"})
    return names


class StoreSeries:
    """Series of every metric family derivable from `results` and governor `decisions`, built once per
    family on demand, plus `extra` gauge series given as such (the thresholds' constant series). Decisions
    are taken in the order given (the store's: oldest first)."""

    def __init__(self, results: Iterable[ProbeResult], decisions: Iterable[GovernorDecision] = (),
                 extra: Iterable[GaugeSeries] = ()) -> None:
        self.results = sorted(results, key=lambda r: (r.created_at, r.result_id))
        self.decisions = list(decisions)
        self.extra: dict[str, list[GaugeSeries]] = {}
        for series in extra:
            self.extra.setdefault(dict(series.labels)[NAME], []).append(series)
        self._gauges: dict[str, list[GaugeSeries]] = {}
        self._counters: dict[str, list[CounterSeries]] = {}

    def kind(self, metric: str) -> str | None:
        """"gauge", "counter" or None for a metric this source cannot produce."""
        if metric in GAUGES or metric in WINDOW_GAUGES or metric in (GOVERNOR_SETTING, ALERT_THRESHOLD) \
                or metric in self.extra:
            return "gauge"
        if metric in counter_names():
            return "counter"
        return None

    def _governor(self, metric: str) -> list[GaugeSeries] | list[CounterSeries]:
        """The setting gauge or the clamp counter, one series per (target, domain) of the decisions."""
        groups: dict[tuple[str, ...], GaugeSeries | CounterSeries] = {}
        for d in self.decisions:
            key = tuple(getattr(d, label) for label in GOVERNOR_LABELS)
            entry = groups.get(key)
            if entry is None:
                labels = labels_of(**{NAME: metric}, **dict(zip(GOVERNOR_LABELS, key)))
                entry = groups[key] = GaugeSeries(labels) if metric == GOVERNOR_SETTING else CounterSeries(labels)
            entry.times.append(d.decided_at.timestamp())
            if isinstance(entry, GaugeSeries):
                entry.values.append(float(d.new_setting))
            else:
                entry.increments.append(1.0 if d.clamped else 0.0)
        return list(groups.values())  # type: ignore[return-value]

    def _windows(self) -> dict[str, list[GaugeSeries]]:
        """The window gauges, replayed result by result through the collector's own QualityWindows and
        LatencyWindows."""
        groups: dict[tuple[str, tuple[tuple[str, str], ...]], GaugeSeries] = {}
        windows = QualityWindows()
        for r in self.results:
            window = windows.add(r)
            if window is None:
                continue
            for family, values in window_samples(window).items():
                for bound, value in values.items():
                    key = (family, (("model", r.model), ("domain", r.domain), ("target", r.target))
                           + ((("bound", bound),) if bound else ()))
                    entry = groups.get(key)
                    if entry is None:
                        entry = groups[key] = GaugeSeries(labels_of(**{NAME: family}, **dict(key[1])))
                    entry.times.append(r.created_at.timestamp())
                    entry.values.append(float(value))
        # The latency windows change only in baseline rounds (every N-th round), while the collector exports
        # their last values all along: each later result of the same target, model and domain samples them
        # again, as a scrape would, so they do not fall out of the lookback between baseline rounds.
        latency = LatencyWindows()
        current: dict[tuple[str, str, str], dict[str, dict[tuple[str, ...], float]]] = {}
        for r in self.results:
            changed = latency.add(r)
            if changed is not None:
                current[(r.target, r.model, r.domain)] = latency_samples(changed)
            for family, samples in current.get((r.target, r.model, r.domain), {}).items():
                for key_values, value in samples.items():
                    names = ("phase", "bound") if family == LATENCY_VS_DENSE else ("phase",)
                    key = (family, (("model", r.model), ("domain", r.domain), ("target", r.target))
                           + tuple(zip(names, key_values)))
                    entry = groups.get(key)
                    if entry is None:
                        entry = groups[key] = GaugeSeries(labels_of(**{NAME: family}, **dict(key[1])))
                    entry.times.append(r.created_at.timestamp())
                    entry.values.append(float(value))
        out: dict[str, list[GaugeSeries]] = {name: [] for name in WINDOW_GAUGES}
        for (family, _), series in groups.items():
            out[family].append(series)
        return out

    def gauges(self, metric: str) -> list[GaugeSeries]:
        return self._derived_gauges(metric) + self.extra.get(metric, [])

    def _derived_gauges(self, metric: str) -> list[GaugeSeries]:
        if metric == ALERT_THRESHOLD or (metric not in GAUGES and metric not in WINDOW_GAUGES
                                         and metric != GOVERNOR_SETTING):
            return []
        if metric in WINDOW_GAUGES:
            if metric not in self._gauges:
                self._gauges.update(self._windows())
            return self._gauges[metric]
        if metric == GOVERNOR_SETTING:
            if metric not in self._gauges:
                self._gauges[metric] = self._governor(metric)  # type: ignore[assignment]
            return self._gauges[metric]
        if metric not in self._gauges:
            spec = GAUGES[metric]
            groups: dict[tuple[tuple[str, str], ...], GaugeSeries] = {}
            for r in self.results:
                if not spec.applies_to(r):
                    continue
                value = spec.value(r)
                if value is None:
                    continue
                key = tuple(zip(spec.labels, spec.label_values(r)))
                entry = groups.get(key)
                if entry is None:
                    entry = groups[key] = GaugeSeries(labels_of(**{NAME: metric}, **dict(key)))
                entry.times.append(r.created_at.timestamp())
                entry.values.append(float(value))
            self._gauges[metric] = list(groups.values())
        return self._gauges[metric]

    def counters(self, metric: str) -> list[CounterSeries]:
        if metric not in self._counters:
            self._counters[metric] = self._build_counters(metric)
        return self._counters[metric]

    def _observations(self, spec: ResultFamily
                      ) -> dict[tuple[tuple[str, str], ...], tuple[list[float], list[float]]]:
        """(times, values) of the results each label set saw, in one pass over the results."""
        groups: dict[tuple[tuple[str, str], ...], tuple[list[float], list[float]]] = {}
        for r in self.results:
            if not spec.applies_to(r):
                continue
            if spec.preset_reasons:  # series the exporter creates at 0 with the first result of their other labels
                at = spec.labels.index("reason")
                values = spec.label_values(r)
                for reason in spec.preset_reasons:
                    preset = tuple(zip(spec.labels, (*values[:at], reason, *values[at + 1:])))
                    if preset not in groups:
                        groups[preset] = ([r.created_at.timestamp()], [0.0])
            observed = spec.value(r)
            if observed is None:
                continue
            key = tuple(zip(spec.labels, spec.label_values(r)))
            entry = groups.get(key)
            if entry is None:
                entry = groups[key] = ([], [])
            entry[0].append(r.created_at.timestamp())
            entry[1].append(float(observed))
        return groups

    def _build_counters(self, metric: str) -> list[CounterSeries]:
        def series(labels: dict[str, str], times: list[float], increments: list[float]) -> CounterSeries:
            return CounterSeries(labels_of(**{NAME: metric}, **labels), times, increments)

        if metric == GOVERNOR_CLAMPS_TOTAL:
            return self._governor(metric)  # type: ignore[return-value]
        if metric in COUNTERS:
            spec = COUNTERS[metric]
            groups = self._observations(spec)
            return [series(dict(key), times, values) for key, (times, values) in groups.items()]
        family, _, suffix = metric.rpartition("_")
        spec = HISTOGRAMS[family]
        groups = self._observations(spec)
        out: list[CounterSeries] = []
        for key, (times, values) in groups.items():
            labels = dict(key)
            if suffix == "count":
                out.append(series(labels, times, [1.0] * len(values)))
            elif suffix == "sum":
                out.append(series(labels, times, values))
            else:
                # Cumulative buckets, as prometheus_client counts them; a zero increment still makes the
                # bucket exist, as every bucket of a labelled histogram does from its first observation.
                for bound in (*spec.buckets, float("inf")):
                    increments = [1.0 if v <= bound else 0.0 for v in values]
                    out.append(series({**labels, "le": floatToGoString(bound)}, times, increments))
        return out
