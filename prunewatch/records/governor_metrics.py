"""The quality governor's metric families: the sensitivity it holds and how often it had to lower it.

    prunewatch_governor_setting{target, domain}        gauge: the governed pruning sensitivity (0..1)
    prunewatch_governor_clamps_total{target, domain}   counter: rounds in which a breach of the floor
                                                       lowered the setting (PruningGovernorClamped)

Registered in the collector's registry (the same /metrics). Each governed (target, domain) is
`track`ed before its first round, so its clamp counter exists at 0 and Prometheus sees the first
clamp as an increase.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge

from prunewatch.records.metrics import check_metric_name

GOVERNOR_SETTING = "prunewatch_governor_setting"
GOVERNOR_CLAMPS = "prunewatch_governor_clamps"  # exposed with _total
GOVERNOR_LABELS = ("target", "domain")


class GovernorMetrics:
    """Gauge and clamp counter of the governor; `on_change` is told after every update (exposition caches)."""

    def __init__(self, registry: CollectorRegistry | None = None, *,
                 on_change: Callable[[], None] | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.on_change = on_change
        self.setting = Gauge(check_metric_name(GOVERNOR_SETTING),
                             "Pruning sensitivity the quality governor holds for the target's domain (0 runs dense).",
                             GOVERNOR_LABELS, registry=self.registry)
        self.clamps = Counter(check_metric_name(GOVERNOR_CLAMPS),
                              "Rounds in which token agreement fell below the governor's floor and it lowered the "
                              "sensitivity.", GOVERNOR_LABELS, registry=self.registry)

    def _changed(self) -> None:
        if self.on_change is not None:
            self.on_change()

    def track(self, target: str, domain: str, setting: float) -> None:
        """Create both series (the counter at 0) with the starting setting."""
        self.setting.labels(target, domain).set(setting)
        self.clamps.labels(target, domain)
        self._changed()

    def record(self, target: str, domain: str, setting: float, *, clamped: bool) -> None:
        self.setting.labels(target, domain).set(setting)
        if clamped:
            self.clamps.labels(target, domain).inc()
        self._changed()
