"""The evaluator's parts in isolation: PromQL subset, Prometheus' quantile, Go-style templates, durations, state."""

from __future__ import annotations

import math
import re
from datetime import timedelta

import pytest

from prunewatch.alerts._engine import Engine, bucket_quantile
from prunewatch.alerts._parser import (
    AGGREGATIONS,
    COMPARISONS,
    PromQLSyntaxError,
    UnsupportedExpression,
    longest_range,
    parse,
    top_level_binary,
)
from prunewatch.alerts._series import StoreSeries
from prunewatch.alerts._templates import UnsupportedTemplate, render
from prunewatch.alerts.durations import format_duration, parse_duration
from prunewatch.alerts.evaluator import AlertEvaluator
from prunewatch.alerts.ruleset import RuleFileError, load_rules
from tests.alerts.conftest import T0, result


def evaluate(expr: str, results, at, lookback_s: float = 300.0):
    engine = Engine(StoreSeries(results), at.timestamp(), lookback_s)
    samples = sorted(engine.vector(parse(expr)), key=lambda s: s.labels)
    return [(dict(s.labels), s.value) for s in samples]


@pytest.mark.parametrize("expr, message", [
    ("rate(prunewatch_probe_results_total[5m:1m])", "subquery"),
    ("prunewatch_pruning_ratio offset 5m", "modifier 'offset'"),
    ("rate(prunewatch_probe_results_total[5m] @ 300)", "modifier '@'"),
    ("prunewatch_pruning_ratio and prunewatch_continuation_agreement", "set operator 'and'"),
    ("prunewatch_pruning_ratio % 2", "operator '%'"),
    ("topk(2, prunewatch_pruning_ratio)", "aggregation 'topk'"),
    ("prunewatch_pruning_ratio / on(model) prunewatch_continuation_agreement", "vector matching modifier 'on'"),
    ("prunewatch_pruning_ratio / ignoring(probe) prunewatch_continuation_agreement", "vector matching modifier 'ignoring'"),
    ("prunewatch_pruning_ratio / fill(0) prunewatch_continuation_agreement", "modifier 'fill'"),
    ('{__name__="prunewatch_pruning_ratio"}', "selector without a metric name"),
    ('prunewatch_pruning_ratio{domain="legal" or domain="tech"}', "'or' between label matchers"),
])
def test_unsupported_promql_names_the_construct(expr: str, message: str) -> None:
    with pytest.raises(UnsupportedExpression, match=message):
        parse(expr)


@pytest.mark.parametrize("expr, reason", [
    ("prunewatch_pruning_ratio[5x]", "bad number or duration syntax: 5x"),
    ("rate(prunewatch_probe_results_total)", "expected type matrix in call to function 'rate', got vector"),
    ("sum by (domain (prunewatch_pruning_ratio)", "unclosed left parenthesis"),
    ("1 > 0", "comparisons between scalars must use BOOL modifier"),
])
def test_syntax_errors_give_the_library_reason_and_the_expression(expr: str, reason: str) -> None:
    with pytest.raises(PromQLSyntaxError, match=re.escape(f"{reason} in {expr!r}")):
        parse(expr)


def test_the_library_spells_operators_as_the_evaluator_dispatches_on_them() -> None:
    """The evaluator reads operators through str(); an upgrade of promql-parser that changes it fails here."""
    for op in ("+", "-", "*", "/", "==", "!=", ">", "<", ">=", "<="):
        modifier = " bool" if op in COMPARISONS else ""
        assert str(parse(f"prunewatch_pruning_ratio {op}{modifier} 1").op) == op
    for op in AGGREGATIONS:
        assert str(parse(f"{op} by (domain) (prunewatch_pruning_ratio)").op) == op


def test_syntax_helpers_read_the_library_ast() -> None:
    assert longest_range(parse("sum(rate(prunewatch_probe_results_total[15m])) / "
                               "avg(avg_over_time(prunewatch_pruning_ratio[1h]))")) == 3600.0
    assert longest_range(parse("prunewatch_pruning_ratio")) == 0.0
    assert top_level_binary("prunewatch_pruning_ratio / 2") and not top_level_binary("(prunewatch_pruning_ratio / 2)")
    assert top_level_binary("prunewatch_pruning_ratio offset 5m > 1")  # syntax only: the subset is not asked
    many = " + ".join(f"avg(avg_over_time(prunewatch_pruning_ratio[{i}m]))" for i in range(1, 401))
    assert longest_range(parse(many)) == 400 * 60.0  # walked in linear time (promql_parser.walk takes minutes)


def test_gauge_windows_include_both_ends_and_instant_selectors_look_back_five_minutes() -> None:
    rows = [result(T0 + timedelta(minutes=m), "legal", "legal-1", ratio=v) for m, v in ((0, 0.2), (5, 0.4))]
    window = "avg_over_time(prunewatch_pruning_ratio[5m])"
    assert evaluate(window, rows, T0 + timedelta(minutes=5))[0][1] == pytest.approx(0.3)  # both samples
    assert evaluate(window, rows, T0 + timedelta(minutes=5, seconds=1))[0][1] == pytest.approx(0.4)
    assert evaluate("prunewatch_pruning_ratio", rows, T0 + timedelta(minutes=10))[0][1] == 0.4
    assert evaluate("prunewatch_pruning_ratio", rows, T0 + timedelta(minutes=10, seconds=1)) == []


def test_rate_counts_results_after_the_window_start() -> None:
    rows = [result(T0 + timedelta(minutes=m), "legal", "legal-1") for m in range(0, 11)]
    got = evaluate("sum by (domain) (rate(prunewatch_probe_results_total[5m]))", rows, T0 + timedelta(minutes=10))
    assert got == [({"domain": "legal"}, 5 / 300)]  # results at 6..10 min; the one at 5 min is the baseline


def test_histogram_quantile_follows_prometheus() -> None:
    inf = math.inf
    assert bucket_quantile(0.99, [(0.5, 4), (1.2, 4), (2.0, 5), (inf, 5)]) == pytest.approx(1.96)
    assert bucket_quantile(0.5, [(0.1, 0), (0.3, 10), (inf, 10)]) == pytest.approx(0.2)
    assert bucket_quantile(0.99, [(1.0, 1), (inf, 10)]) == 1.0  # in the +Inf bucket: the highest finite bound
    assert math.isnan(bucket_quantile(0.99, [(1.0, 1), (2.0, 2)]))  # no +Inf bucket
    assert math.isnan(bucket_quantile(0.99, [(1.0, 0), (inf, 0)]))  # no observations
    assert bucket_quantile(0.5, [(0.5, 3), (1.0, 2), (inf, 4)]) == pytest.approx(0.5 * (2 / 3))  # made monotonic


def test_latency_p99_from_stored_results() -> None:
    rows = [result(T0 + timedelta(seconds=s), "legal", "legal-1", inference_ms=ms)
            for s, ms in ((10, 400.0), (20, 450.0), (30, 1500.0))]
    p99 = "histogram_quantile(0.99, sum by (le, domain) (rate(prunewatch_inference_latency_seconds_bucket[5m])))"
    got = evaluate(p99, rows, T0 + timedelta(minutes=1))
    # 2 of 3 observations in (0.3, 0.5], 1 in (1.2, 2.0]: rank 2.97 interpolates inside the top bucket
    assert got == [({"domain": "legal"}, pytest.approx(1.2 + 0.8 * 0.97))]


def test_comparisons_filter_and_keep_the_left_value() -> None:
    rows = [result(T0, "legal", "legal-1", ratio=0.5), result(T0, "tech", "tech-1", ratio=0.2)]
    assert evaluate("prunewatch_pruning_ratio > 0.3", rows, T0) == [
        ({"__name__": "prunewatch_pruning_ratio", "domain": "legal", "model": "probe-llama", "probe": "legal-1",
          "target": "embedded"}, 0.5)]
    assert [v for _, v in evaluate("prunewatch_pruning_ratio > bool 0.3", rows, T0)] == [1.0, 0.0]
    assert evaluate("0.3 < prunewatch_pruning_ratio", rows, T0)[0][1] == 0.5


def test_vector_division_matches_on_labels_and_scalars_need_bool() -> None:
    rows = [result(T0, "legal", "legal-1", ratio=0.25), result(T0, "legal", "legal-1", ratio=0.25,
                                                                 status="failed", reason="timeout")]
    rows[1].created_at = T0
    got = evaluate("sum by (domain) (rate(prunewatch_probe_failures_total[5m]))"
                   " / sum by (domain) (rate(prunewatch_probe_results_total[5m]))", rows, T0)
    assert got == [({"domain": "legal"}, 0.5)]
    assert evaluate("sum by (domain) (prunewatch_pruning_ratio) / sum by (model) (prunewatch_pruning_ratio)",
                    rows, T0) == []  # no label set in common: nothing matches
    assert evaluate("prunewatch_pruning_ratio * (1 > bool 0)", rows, T0)[0][1] == 0.25


def test_counters_and_unknown_metrics_are_refused_with_a_reason() -> None:
    with pytest.raises(UnsupportedExpression, match="use rate\\(\\) or increase\\(\\)"):
        evaluate("prunewatch_probe_results_total > 5", [], T0)
    with pytest.raises(UnsupportedExpression, match="prunewatch_engine_requests_total is not derived"):
        evaluate("rate(prunewatch_engine_requests_total[5m])", [], T0)
    with pytest.raises(UnsupportedExpression, match="over gauge"):
        evaluate("rate(prunewatch_pruning_ratio[5m])", [], T0)


@pytest.mark.parametrize("template, value, expected", [
    ('{{ $value | printf "%.3f" }}', 0.4567, "0.457"),
    ('{{ printf "%.0f" $value }} results', 150.0, "150 results"),
    ("{{ $value }}", 1234567.0, "1.234567e+06"),
    ("{{ $value }}", 0.25, "0.25"),
    ("{{ $value }}", 1e-05, "1e-05"),
    ('{{ $value | printf "%.2f" }}', math.nan, "NaN"),
    ("{{ $labels.domain }}/{{ $labels.missing }}", 1.0, "legal/"),
])
def test_templates_render_as_go_does(template: str, value: float, expected: str) -> None:
    assert render(template, {"domain": "legal"}, value) == expected


def test_unsupported_template_is_refused() -> None:
    with pytest.raises(UnsupportedTemplate, match="humanizePercentage"):
        render("{{ $value | humanizePercentage }}", {}, 0.5)
    with pytest.raises(UnsupportedTemplate, match="%d of a float"):
        render('{{ $value | printf "%d" }}', {}, 1.0)


def test_durations_round_trip_in_prometheus_notation() -> None:
    assert parse_duration("1h30m") == timedelta(minutes=90)
    assert parse_duration("1d") == timedelta(days=1)
    assert format_duration(timedelta(minutes=90)) == "1h30m"
    assert format_duration(timedelta(0)) == "0s"
    assert format_duration(timedelta(days=7)) == "1w" and parse_duration("1w") == timedelta(days=7)
    for zero in ("0", "0s", "0h0m"):  # rule files accept a zero hold time; promql-parser alone refuses it
        assert parse_duration(zero) == timedelta(0)
    for bad in ("90", "30m1h", "1h 30m", "", "2 hours", "0s0h", "1.5h"):
        with pytest.raises(ValueError, match="duration"):
            parse_duration(bad)
    with pytest.raises(ValueError):
        format_duration(timedelta(seconds=-1))


RULES = """
groups:
- name: g
  rules:
  - alert: High
    expr: avg by (domain) (prunewatch_pruning_ratio) > 0.5
    for: 2m
    labels: {severity: warning}
    annotations: {summary: '{{ $labels.domain }} at {{ $value | printf "%.2f" }}'}
"""


def test_for_semantics_and_a_new_episode_after_resolution(tmp_path) -> None:
    path = tmp_path / "rules.yml"
    path.write_text(RULES)
    evaluator = AlertEvaluator(load_rules(path))
    high = [result(T0 + timedelta(minutes=m), "legal", "legal-1", ratio=0.6) for m in range(0, 4)]
    low = [result(T0 + timedelta(minutes=4), "legal", "legal-1", ratio=0.1)]
    kinds = []
    for minute in range(0, 6):
        at = T0 + timedelta(minutes=minute)
        evaluation = evaluator.evaluate(at, StoreSeries(high + low))
        kinds.append([t.kind for t in evaluation.transitions])
        if minute == 1:
            assert [a.state for a in evaluator.alerts()] == ["pending"]
    assert kinds == [[], [], ["firing"], [], ["resolved"], []]
    assert evaluator.alerts() == []
    again = high + low + [result(T0 + timedelta(minutes=6), "legal", "legal-1", ratio=0.7)]
    evaluator.evaluate(T0 + timedelta(minutes=6), StoreSeries(again))
    assert evaluator.alerts()[0].active_at == T0 + timedelta(minutes=6)  # a new episode, a new key
    assert evaluator.alerts()[0].annotations == {"summary": "legal at 0.70"}


def test_restoring_state_keeps_firing_but_restarts_stale_pending(tmp_path) -> None:
    path = tmp_path / "rules.yml"
    path.write_text(RULES)
    rows = [result(T0 + timedelta(minutes=m), "legal", "legal-1", ratio=0.6) for m in range(0, 3)]
    rows += [result(T0 + timedelta(minutes=2), "tech", "tech-1", ratio=0.6)]
    first = AlertEvaluator(load_rules(path))
    for minute in range(0, 3):
        first.evaluate(T0 + timedelta(minutes=minute), StoreSeries(rows))
    state = first.export_state()
    assert sorted(a["state"] for a in state["alerts"]) == ["firing", "pending"]

    soon = AlertEvaluator(load_rules(path))
    assert soon.restore_state(state, T0 + timedelta(minutes=4)) == 2
    late = AlertEvaluator(load_rules(path))
    assert late.restore_state(state, T0 + timedelta(minutes=30)) == 1  # pending tech restarts its 2m
    assert [a.label("domain") for a in late.alerts()] == ["legal"]


def test_broken_rule_files_fail_with_one_line(tmp_path) -> None:
    with pytest.raises(RuleFileError, match="cannot read rule file"):
        load_rules(tmp_path / "missing.yml")
    bad = tmp_path / "bad.yml"
    bad.write_text("groups: [ {")
    with pytest.raises(RuleFileError, match="not valid YAML"):
        load_rules(bad)
    bad.write_text("groups:\n- name: g\n  rules:\n  - alert: A\n    expr: x > 1\n    for: soon\n")
    with pytest.raises(RuleFileError, match="rule g/A: duration 'soon'"):
        load_rules(bad)
