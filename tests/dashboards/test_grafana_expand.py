"""The Grafana query expansion the live test relies on behaves like Grafana for the forms we use."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from tests.dashboards.grafana_expand import Selection, expand_promql, expand_sql, prometheus_regex_escape

SELECTION = Selection(
    values={"model": ["probe-llama"], "domain": ["legal", "tech"], "target": ["o'brien"]},
    constants={"gpu_usd_per_hour": "2.5"},
    time_from=datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC),
    time_to=datetime(2026, 1, 2, 3, 9, 5, tzinfo=UTC),
    interval="15s", rate_interval="1m")


def test_promql_variables_become_regex_alternations_and_intervals_are_filled():
    expr = '${gpu_usd_per_hour} * rate(x{model=~"$model", domain=~"$domain"}[$__rate_interval]) [$__range]'
    assert expand_promql(expr, SELECTION) == (
        '2.5 * rate(x{model=~"probe-llama", domain=~"(legal|tech)"}[1m]) [300s]')


def test_regex_metacharacters_are_escaped_like_grafana_does():
    assert prometheus_regex_escape("llama-3.1 (8b)") == "llama-3\\\\.1 \\\\(8b\\\\)"


def test_sql_variables_become_quoted_lists_and_macros_expand():
    sql = ("SELECT $__timeGroupAlias(created_at, $__interval), count(*) FROM t "
           "WHERE $__timeFilter(created_at) AND domain IN ($domain) AND target IN ($target)")
    assert expand_sql(sql, SELECTION) == (
        'SELECT floor(extract(epoch from created_at)/15)*15 AS "time", count(*) FROM t '
        "WHERE created_at BETWEEN '2026-01-02T03:04:05Z' AND '2026-01-02T03:09:05Z' "
        "AND domain IN ('legal','tech') AND target IN ('o''brien')")


def test_unknown_variables_fail_instead_of_reaching_the_server():
    with pytest.raises(KeyError, match=r"unknown variable \$modle"):
        expand_promql('x{model=~"$modle"}', SELECTION)
    with pytest.raises(KeyError, match=r"unsupported macro \$__timeEpoch"):
        expand_sql("SELECT $__timeEpoch(created_at)", SELECTION)
