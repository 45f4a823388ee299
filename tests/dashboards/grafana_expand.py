"""What Grafana does to a panel query before the datasource sees it, for the queries our dashboards use.

Grafana interpolates template variables (formatted per datasource: a regex alternation for
Prometheus, a quoted list for SQL), its built-in interval variables, and for SQL datasources the
$__time* macros. This reproduces that for the forms the dashboards use, and refuses anything else,
so a typo in a variable name fails the test instead of reaching the server as a literal `$typo`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import UTC, datetime

_VARIABLE = re.compile(r"\$\{(\w+)\}|\$(\w+)")
_DURATION = re.compile(r"^(\d+)(ms|s|m|h|d)$")
_SECONDS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400}


def duration_seconds(text: str) -> float:
    match = _DURATION.match(text.strip().strip("'\""))
    if not match:
        raise ValueError(f"not a Grafana interval: {text!r}")
    return int(match.group(1)) * _SECONDS[match.group(2)]


def prometheus_regex_escape(value: str) -> str:
    """Grafana's escaping of a variable value used inside a PromQL regex matcher string."""
    value = value.replace("\\", "\\\\\\\\")
    return re.sub(r"[$^*{}\[\]'+?.()|]", lambda m: "\\\\" + m.group(0), value)


@dataclass(frozen=True)
class Selection:
    """The dashboard state a query is expanded for."""

    values: dict[str, list[str]]  # query variables: the selected values ("All" = every listed value)
    constants: dict[str, str]  # textbox variables
    time_from: datetime
    time_to: datetime
    interval: str  # $__interval
    rate_interval: str  # $__rate_interval

    @property
    def range(self) -> str:
        return f"{max(1, round((self.time_to - self.time_from).total_seconds()))}s"


def _builtins(selection: Selection) -> dict[str, str]:
    return {"__interval": selection.interval, "__rate_interval": selection.rate_interval,
            "__range": selection.range}


def _substitute(text: str, lookup) -> str:
    def replace(match: re.Match[str]) -> str:
        name = match.group(1) or match.group(2)
        if name.startswith("__time") or name.startswith("__unixEpoch"):
            return match.group(0)  # SQL macros, expanded afterwards
        return lookup(name)

    return _VARIABLE.sub(replace, text)


def expand_promql(text: str, selection: Selection) -> str:
    """The PromQL Grafana sends for `text` under `selection`."""
    builtins = _builtins(selection)

    def lookup(name: str) -> str:
        if name in builtins:
            return builtins[name]
        if name in selection.constants:
            return selection.constants[name]
        if name in selection.values:
            values = [prometheus_regex_escape(v) for v in selection.values[name]]
            if not values:
                raise ValueError(f"variable ${name} has no value to substitute")
            return values[0] if len(values) == 1 else "(" + "|".join(values) + ")"
        raise KeyError(f"unknown variable ${name} in {text!r}")

    expanded = _substitute(text, lookup)
    if "$" in expanded:
        raise ValueError(f"unexpanded $ left in {expanded!r}")
    return expanded


def _quote_sql(value: str) -> str:
    return "'" + value.replace("'", "''") + "'"


def _timestamp(value: datetime) -> str:
    return value.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _split_args(inner: str) -> list[str]:
    return [part.strip() for part in inner.split(",")]


def expand_sql(text: str, selection: Selection) -> str:
    """The SQL Grafana's PostgreSQL datasource runs for `text` under `selection`."""
    builtins = _builtins(selection)

    def lookup(name: str) -> str:
        if name in builtins:
            return builtins[name]
        if name in selection.constants:
            return selection.constants[name]
        if name in selection.values:
            values = selection.values[name]
            if not values:
                raise ValueError(f"variable ${name} has no value to substitute")
            return ",".join(_quote_sql(v) for v in values)
        raise KeyError(f"unknown variable ${name} in {text!r}")

    expanded = _substitute(text, lookup)
    start, end = _timestamp(selection.time_from), _timestamp(selection.time_to)

    def macro(match: re.Match[str]) -> str:
        name, args = match.group(1), _split_args(match.group(2))
        if name == "__timeFilter":
            return f"{args[0]} BETWEEN '{start}' AND '{end}'"
        if name in ("__timeGroup", "__timeGroupAlias"):
            seconds = int(duration_seconds(args[1]))
            group = f"floor(extract(epoch from {args[0]})/{seconds})*{seconds}"
            return group + (' AS "time"' if name == "__timeGroupAlias" else "")
        raise KeyError(f"unsupported macro ${name}")

    expanded = re.sub(r"\$(__\w+)\(([^()]*)\)", macro, expanded)
    if "$" in expanded:
        raise ValueError(f"unexpanded $ left in {expanded!r}")
    return expanded
