"""The template variables (model, domain, target) of each datasource, defined once."""

from __future__ import annotations

from prunewatch.dashboards import promql, sql
from prunewatch.dashboards.panels import Json, query_variable

_MODEL = "Model name as the engine reports it."
_DOMAIN = "Probe domain (legal, tech, finance, ...)."
_TARGET_PROM = ("Probed target (every target that recorded a probe, failing ones too). It filters the "
                "per-target panels (probe wall time, freshness) and the PostgreSQL panels; per-probe "
                "metrics are labelled by model and domain only.")
_TARGET_SQL = "Probed target (engine or server) as the collector names it."


def prometheus_variables(datasource: Json) -> list[Json]:
    """model, domain, target from Prometheus label values."""
    return [query_variable("model", datasource, promql.VAR_MODEL, _MODEL),
            query_variable("domain", datasource, promql.VAR_DOMAIN, _DOMAIN),
            query_variable("target", datasource, promql.VAR_TARGET, _TARGET_PROM)]


def postgres_variables(datasource: Json) -> list[Json]:
    """model, domain, target from the probe_results table (every target, failing ones too)."""
    return [query_variable("model", datasource, sql.VAR_MODEL, _MODEL),
            query_variable("domain", datasource, sql.VAR_DOMAIN, _DOMAIN),
            query_variable("target", datasource, sql.VAR_TARGET, _TARGET_SQL)]
