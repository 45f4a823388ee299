"""Grafana dashboards as code: built from Python, committed as JSON, provisioned or pushed to Grafana.

Pushing needs grafana-client (the `dashboards` extra): its names are resolved on first use, so building and
exporting dashboards work without it.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

from prunewatch.dashboards.build import DASHBOARD_BUILDERS, build_dashboards
from prunewatch.dashboards.export import check_exported, export_dashboards
from prunewatch.dashboards.queries import PanelQuery, panel_queries, template_variables
from prunewatch.dashboards.settings import DashboardSettings

_PUSH = ("GrafanaPushError", "PushReport", "PushSettings", "push_dashboards")

__all__ = [
    "DASHBOARD_BUILDERS",
    "DashboardSettings",
    "GrafanaPushError",
    "PanelQuery",
    "PushReport",
    "PushSettings",
    "build_dashboards",
    "check_exported",
    "export_dashboards",
    "panel_queries",
    "push_dashboards",
    "template_variables",
]


def __getattr__(name: str) -> Any:
    if name not in _PUSH:
        raise AttributeError(f"module 'prunewatch.dashboards' has no attribute {name!r}")
    value = getattr(import_module("prunewatch.dashboards.push"), name)
    globals()[name] = value
    return value
