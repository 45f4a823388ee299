"""Small builders for classic Grafana dashboard JSON (schemaVersion 39), as plain dicts.

Plain dicts rather than an SDK: the output is the artefact under review (committed JSON), and
every key written here is one Grafana 10.2.3 to 12 imports as is. Panels are placed left to
right, top to bottom, by `Layout`, so builders only say how wide and tall a panel is.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from prunewatch.dashboards.settings import DashboardSettings

SCHEMA_VERSION = 39  # Grafana 10.3/10.4; 11 and 12 migrate it on load
PROMETHEUS_TYPE = "prometheus"
POSTGRES_TYPE = "grafana-postgresql-datasource"  # the plugin id since Grafana 10.2.3 ("postgres" before)
GRID_WIDTH = 24
TAG = "prunewatch"

Json = dict[str, Any]


@dataclass(frozen=True)
class Datasources:
    """Datasource references panels and variables point at (by uid, as provisioning creates them)."""

    prometheus: Json
    postgres: Json

    @classmethod
    def from_settings(cls, settings: DashboardSettings) -> Datasources:
        return cls(prometheus={"type": PROMETHEUS_TYPE, "uid": settings.prometheus_uid},
                   postgres={"type": POSTGRES_TYPE, "uid": settings.postgres_uid})


# -- queries ---------------------------------------------------------------------------------
def prom(ref: str, expr: str, legend: str = "", *, instant: bool = False, table: bool = False) -> Json:
    """A Prometheus target; `instant` panels (stat, table, bar gauge) read only the latest value."""
    target: Json = {"editorMode": "code", "expr": expr, "legendFormat": legend or "__auto", "refId": ref,
                    "range": not instant, "instant": instant}
    if table:
        target["format"] = "table"
    return target


def pg(ref: str, raw_sql: str, *, table: bool = False) -> Json:
    """A PostgreSQL target in code mode; time series format needs columns time, metric, value."""
    return {"editorMode": "code", "format": "table" if table else "time_series", "rawQuery": True,
            "rawSql": raw_sql, "refId": ref}


# -- panels ----------------------------------------------------------------------------------
_LEGEND = {"calcs": [], "displayMode": "list", "placement": "bottom", "showLegend": True}
_REDUCE_LAST = {"calcs": ["lastNotNull"], "fields": "", "values": False}


def _panel(kind: str, title: str, description: str, datasource: Json, targets: list[Json], *, width: int,
           height: int, unit: str | None, options: Json, defaults: Json | None = None,
           overrides: list[Json] | None = None) -> Json:
    if not description:
        raise ValueError(f"panel {title!r} needs a description saying how its numbers are obtained")
    if not 1 <= width <= GRID_WIDTH:
        raise ValueError(f"panel {title!r}: width {width} outside 1..{GRID_WIDTH}")
    field_defaults: Json = dict(defaults or {})
    if unit:
        field_defaults["unit"] = unit
    return {
        "datasource": datasource,
        "description": description,
        "fieldConfig": {"defaults": field_defaults, "overrides": list(overrides or [])},
        "gridPos": {"h": height, "w": width, "x": 0, "y": 0},
        "options": options,
        "targets": [dict(t, datasource=datasource) for t in targets],
        "title": title,
        "type": kind,
    }


def timeseries(title: str, description: str, datasource: Json, targets: list[Json], *, unit: str | None = None,
               width: int = 12, height: int = 8, bars: bool = False, stacked: bool = False,
               thresholds: list[tuple[str, float | None]] | None = None, minimum: float | None = None,
               maximum: float | None = None, overrides: list[Json] | None = None) -> Json:
    custom: Json = {"drawStyle": "bars" if bars else "line", "fillOpacity": 80 if bars else 10, "lineWidth": 1,
                    "showPoints": "auto", "spanNulls": False,
                    "stacking": {"group": "A", "mode": "normal" if stacked else "none"}}
    defaults: Json = {"custom": custom}
    if thresholds:
        defaults["thresholds"] = {"mode": "absolute",
                                  "steps": [{"color": color, "value": value} for color, value in thresholds]}
        custom["thresholdsStyle"] = {"mode": "line"}
    if minimum is not None:
        defaults["min"] = minimum
    if maximum is not None:
        defaults["max"] = maximum
    return _panel("timeseries", title, description, datasource, targets, width=width, height=height, unit=unit,
                  options={"legend": _LEGEND, "tooltip": {"mode": "multi", "sort": "desc"}}, defaults=defaults,
                  overrides=overrides)


def stat(title: str, description: str, datasource: Json, targets: list[Json], *, unit: str | None = None,
         width: int = 6, height: int = 6, decimals: int | None = None) -> Json:
    defaults: Json = {"decimals": decimals} if decimals is not None else {}
    return _panel("stat", title, description, datasource, targets, width=width, height=height, unit=unit,
                  options={"colorMode": "value", "graphMode": "none", "justifyMode": "auto",
                           "orientation": "auto", "reduceOptions": _REDUCE_LAST, "textMode": "value_and_name"},
                  defaults=defaults)


def bargauge(title: str, description: str, datasource: Json, targets: list[Json], *, unit: str | None = None,
             width: int = 6, height: int = 8) -> Json:
    return _panel("bargauge", title, description, datasource, targets, width=width, height=height, unit=unit,
                  options={"displayMode": "basic", "orientation": "horizontal", "reduceOptions": _REDUCE_LAST,
                           "showUnfilled": True, "valueMode": "color"},
                  defaults={"min": 0})


def table(title: str, description: str, datasource: Json, targets: list[Json], *, width: int = 12,
          height: int = 8, unit: str | None = None) -> Json:
    return _panel("table", title, description, datasource, targets, width=width, height=height, unit=unit,
                  options={"cellHeight": "sm", "footer": {"show": False, "reducer": ["sum"], "fields": ""},
                           "showHeader": True})


def barchart(title: str, description: str, datasource: Json, targets: list[Json], *, x_field: str,
             width: int = 12, height: int = 8, unit: str | None = None) -> Json:
    return _panel("barchart", title, description, datasource, targets, width=width, height=height, unit=unit,
                  options={"legend": _LEGEND, "orientation": "auto", "showValue": "always", "xField": x_field,
                           "tooltip": {"mode": "single", "sort": "none"}},
                  defaults={"min": 0})


def scatter(title: str, description: str, datasource: Json, targets: list[Json], *, x_field: str,
            line_fields: tuple[str, ...] = (), width: int = 12, height: int = 9, unit: str | None = None,
            x_unit: str | None = None) -> Json:
    """An XY chart of one table frame: `x_field` against every other number field; `line_fields` drawn as lines."""
    overrides = [{"matcher": {"id": "byName", "options": name},
                  "properties": [{"id": "custom.show", "value": "lines"}]} for name in line_fields]
    if x_unit:
        overrides.append({"matcher": {"id": "byName", "options": x_field},
                          "properties": [{"id": "unit", "value": x_unit}]})
    return _panel("xychart", title, description, datasource, targets, width=width, height=height, unit=unit,
                  options={"dims": {"frame": 0, "x": x_field}, "legend": _LEGEND, "series": [],
                           "seriesMapping": "auto", "tooltip": {"mode": "single", "sort": "none"}},
                  defaults={"custom": {"show": "points", "pointSize": {"fixed": 6, "min": 1, "max": 20},
                                       "lineWidth": 2}},
                  overrides=overrides)


def row(title: str) -> Json:
    """A full-width section header."""
    return {"collapsed": False, "gridPos": {"h": 1, "w": GRID_WIDTH, "x": 0, "y": 0}, "panels": [],
            "title": title, "type": "row"}


# -- layout ----------------------------------------------------------------------------------
@dataclass
class Layout:
    """Places panels left to right and wraps at the grid width; ids follow placement order."""

    panels: list[Json] = field(default_factory=list)
    _x: int = field(default=0, init=False)  # next free column in the current row
    _y: int = field(default=0, init=False)  # top of the current row
    _row_height: int = field(default=0, init=False)  # tallest panel placed in the current row

    def add(self, *panels: Json) -> Layout:
        for panel in panels:
            width, height = panel["gridPos"]["w"], panel["gridPos"]["h"]
            if panel["type"] == "row" or self._x + width > GRID_WIDTH:
                self._y += self._row_height
                self._x, self._row_height = 0, 0
            placed = dict(panel, id=len(self.panels) + 1, gridPos={"h": height, "w": width, "x": self._x, "y": self._y})
            self.panels.append(placed)
            self._x += width
            self._row_height = max(self._row_height, height)
            if panel["type"] == "row":
                self._y += height
                self._x, self._row_height = 0, 0
        return self


# -- variables and the dashboard -------------------------------------------------------------
def query_variable(name: str, datasource: Json, query: str, description: str) -> Json:
    """A multi-select variable with "All"; no custom all value, so All expands to the listed values,
    which both PromQL regex matchers and SQL `IN (...)` accept."""
    return {"current": {"selected": True, "text": ["All"], "value": ["$__all"]}, "datasource": datasource,
            "definition": query, "description": description, "hide": 0, "includeAll": True, "label": name,
            "multi": True, "name": name, "options": [], "query": query, "refresh": 2, "regex": "", "skipUrlSync": False,
            "sort": 1, "type": "query"}


def textbox_variable(name: str, label: str, value: float, description: str) -> Json:
    text = f"{value:g}"
    return {"current": {"selected": False, "text": text, "value": text}, "description": description, "hide": 0,
            "label": label, "name": name, "options": [{"selected": True, "text": text, "value": text}],
            "query": text, "skipUrlSync": False, "type": "textbox"}


def dashboard(*, uid: str, title: str, description: str, layout: Layout, variables: list[Json],
              settings: DashboardSettings) -> Json:
    return {
        "annotations": {"list": [{"builtIn": 1, "datasource": {"type": "grafana", "uid": "-- Grafana --"},
                                  "enable": True, "hide": True, "iconColor": "rgba(0, 211, 255, 1)",
                                  "name": "Annotations & Alerts", "type": "dashboard"}]},
        "description": description,
        "editable": True,
        "fiscalYearStartMonth": 0,
        "graphTooltip": 1,
        "id": None,
        "links": [{"asDropdown": False, "icon": "external link", "includeVars": True, "keepTime": True,
                   "tags": [TAG], "targetBlank": False, "title": "prunewatch", "type": "dashboards"}],
        "panels": layout.panels,
        "refresh": settings.refresh,
        "schemaVersion": SCHEMA_VERSION,
        "tags": [TAG],
        "templating": {"list": variables},
        "time": {"from": settings.time_from, "to": "now"},
        "timepicker": {},
        "timezone": "utc",
        "title": title,
        "uid": uid,
        "weekStart": "",
    }
