"""All dashboards, by the file name they are exported under."""

from __future__ import annotations

from collections.abc import Callable

from prunewatch.dashboards.engine_detail import build_engine_detail
from prunewatch.dashboards.history import build_history
from prunewatch.dashboards.overview import build_overview
from prunewatch.dashboards.panels import Json
from prunewatch.dashboards.settings import DashboardSettings

DASHBOARD_BUILDERS: dict[str, Callable[[DashboardSettings], Json]] = {
    "prunewatch-overview.json": build_overview,
    "prunewatch-engine.json": build_engine_detail,
    "prunewatch-history.json": build_history,
}


def build_dashboards(settings: DashboardSettings | None = None) -> dict[str, Json]:
    """Every dashboard as Grafana JSON, keyed by file name (the defaults build the committed files)."""
    settings = settings or DashboardSettings()
    return {name: builder(settings) for name, builder in DASHBOARD_BUILDERS.items()}
