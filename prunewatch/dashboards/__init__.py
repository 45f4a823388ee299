"""Grafana dashboards as code: built from Python, committed as JSON, provisioned or pushed to Grafana."""

from prunewatch.dashboards.build import DASHBOARD_BUILDERS, build_dashboards
from prunewatch.dashboards.export import check_exported, export_dashboards
from prunewatch.dashboards.push import GrafanaPushError, PushReport, PushSettings, push_dashboards
from prunewatch.dashboards.queries import PanelQuery, panel_queries, template_variables
from prunewatch.dashboards.settings import DashboardSettings

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
