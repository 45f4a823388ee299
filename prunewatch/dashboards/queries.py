"""Read the queries back out of built dashboards: what the tests execute, and what a reviewer lists."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from prunewatch.dashboards.panels import POSTGRES_TYPE, PROMETHEUS_TYPE, Json


@dataclass(frozen=True)
class PanelQuery:
    """One query of one panel (or of a template variable, where `panel` names the variable)."""

    dashboard: str  # dashboard uid
    panel: str  # panel title, or "variable <name>"
    ref_id: str
    language: str  # "promql" or "sql"
    text: str
    instant: bool  # Grafana asks Prometheus for the latest value only

    @property
    def label(self) -> str:
        return f"{self.dashboard} / {self.panel} / {self.ref_id}"


def _language(datasource: Json) -> str:
    kind = datasource.get("type")
    if kind == PROMETHEUS_TYPE:
        return "promql"
    if kind == POSTGRES_TYPE:
        return "sql"
    raise ValueError(f"unknown datasource type {kind!r}")


def _panels(panels: list[Json]) -> Iterator[Json]:
    for panel in panels:
        yield panel
        yield from _panels(panel.get("panels", []))  # collapsed rows nest their panels


def panel_queries(dashboard: Json) -> list[PanelQuery]:
    """Every target of every panel, in panel order."""
    found = []
    for panel in _panels(dashboard["panels"]):
        for target in panel.get("targets", []):
            datasource = target.get("datasource") or panel["datasource"]
            language = _language(datasource)
            found.append(PanelQuery(
                dashboard=dashboard["uid"], panel=panel["title"], ref_id=target["refId"], language=language,
                text=target["expr"] if language == "promql" else target["rawSql"],
                instant=bool(target.get("instant", False))))
    return found


def template_variables(dashboard: Json) -> list[PanelQuery]:
    """The query-type template variables (their query is run to list the values a user can pick)."""
    return [PanelQuery(dashboard=dashboard["uid"], panel=f"variable {v['name']}", ref_id=v["name"],
                       language=_language(v["datasource"]), text=v["query"], instant=True)
            for v in dashboard["templating"]["list"] if v["type"] == "query"]
