"""Evaluate the supported PromQL subset at one instant over `StoreSeries`, with Prometheus 2.x semantics.

The expression is promql-parser's AST as `prunewatch.alerts._parser.parse` returned it (already type-checked by
the library and limited to the subset), so this module only walks it.

Ranges include both ends ([t - w, t]) for gauges; a counter's increase over a range counts the
increments in (t - w, t], which is what Prometheus' rate() gives for a counter scraped on a grid
aligned with the range (extrapolation factor 1). Instant selectors look back `lookback` seconds.
Comparisons without `bool` filter and keep the left value; arithmetic drops the metric name;
vector/vector operations match one-to-one on all labels but the name, as Prometheus does.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable
from dataclasses import dataclass

from promql_parser import (
    AggModifierType,
    AggregateExpr,
    BinaryExpr,
    BinModifier,
    Call,
    Expr,
    LabelModifierType,
    MatrixSelector,
    NumberLiteral,
    ParenExpr,
    UnaryExpr,
    VectorMatchCardinality,
    VectorSelector,
)

from prunewatch.alerts._parser import COMPARISONS, Matcher, UnsupportedExpression, label_matchers
from prunewatch.alerts._series import NAME, CounterSeries, GaugeSeries, Labels, StoreSeries


class EvaluationError(ValueError):
    """The expression is supported but cannot be evaluated on this data (e.g. duplicate series in a match)."""


@dataclass(frozen=True)
class Sample:
    labels: Labels
    value: float

    def label(self, name: str) -> str:
        for key, value in self.labels:
            if key == name:
                return value
        return ""


Vector = list[Sample]
Value = float | Vector


@dataclass(frozen=True)
class RecordedRule:
    """A recording rule the evaluator can expand when its name is used as an instant selector."""

    name: str
    expr: Expr
    labels: tuple[tuple[str, str], ...] = ()


def _drop(labels: Labels, *names: str) -> Labels:
    return tuple((k, v) for k, v in labels if k not in names)


def _metric(selector: VectorSelector) -> str:
    if selector.name is None:  # `parse` refuses these; an AST built elsewhere may still hold one
        raise UnsupportedExpression("selector without a metric name")
    return selector.name


def _matching(matchers: tuple[Matcher, ...], labels: Labels) -> bool:
    values = dict(labels)
    return all(m.matches(values.get(m.name, "")) for m in matchers)


def _set(labels: Labels, extra: dict[str, str]) -> Labels:
    merged = dict(labels)
    merged.update(extra)
    return tuple(sorted(merged.items()))


def _div(a: float, b: float) -> float:
    if b == 0:
        if a == 0 or math.isnan(a):
            return math.nan
        return math.copysign(math.inf, a) * (math.copysign(1.0, b))
    return a / b


_ARITHMETIC: dict[str, Callable[[float, float], float]] = {
    "+": operator.add, "-": operator.sub, "*": operator.mul, "/": _div,
}
_COMPARE: dict[str, Callable[[float, float], bool]] = {
    "==": operator.eq, "!=": operator.ne, ">": operator.gt, "<": operator.lt, ">=": operator.ge, "<=": operator.le,
}


def bucket_quantile(q: float, buckets: list[tuple[float, float]]) -> float:
    """Prometheus 2.42's bucketQuantile over (upper bound, cumulative count) pairs."""
    if math.isnan(q):
        return math.nan
    if q < 0:
        return -math.inf
    if q > 1:
        return math.inf
    ordered = sorted(buckets)
    if not ordered or not math.isinf(ordered[-1][0]):
        return math.nan
    merged: list[list[float]] = []
    for bound, count in ordered:  # coalesce equal upper bounds
        if merged and merged[-1][0] == bound:
            merged[-1][1] += count
        else:
            merged.append([bound, count])
    highest = -math.inf
    for entry in merged:  # ensure monotonic counts
        if entry[1] > highest:
            highest = entry[1]
        elif entry[1] < highest:
            entry[1] = highest
    if len(merged) < 2:
        return math.nan
    observations = merged[-1][1]
    if observations == 0:
        return math.nan
    rank = q * observations
    b = next((i for i in range(len(merged) - 1) if merged[i][1] >= rank), len(merged) - 1)
    if b == len(merged) - 1:
        return merged[-2][0]
    if b == 0 and merged[0][0] <= 0:
        return merged[0][0]
    start, end, count = 0.0, merged[b][0], merged[b][1]
    if b > 0:
        start = merged[b - 1][0]
        count -= merged[b - 1][1]
        rank -= merged[b - 1][1]
    return start + (end - start) * (rank / count)


class Engine:
    """One evaluation instant `at` (seconds since the epoch) over one `StoreSeries`."""

    RANGE_FUNCTIONS = frozenset({"rate", "increase", "avg_over_time", "min_over_time", "max_over_time",
                                 "sum_over_time", "count_over_time", "last_over_time", "absent_over_time"})

    def __init__(self, source: StoreSeries, at: float, lookback_s: float,
                 recorded: dict[str, list[RecordedRule]] | None = None) -> None:
        self.source = source
        self.at = at
        self.lookback_s = lookback_s
        self.recorded = recorded or {}
        self._expanding: set[str] = set()

    def vector(self, node: Expr) -> Vector:
        value = self.eval(node)
        if not isinstance(value, list):
            raise UnsupportedExpression("a rule expression must give an instant vector, not a scalar")
        return value

    def _scalar(self, node: Expr, what: str) -> float:
        value = self.eval(node)
        if not isinstance(value, float):
            raise UnsupportedExpression(f"{what} must be a number")
        return value

    def eval(self, node: Expr) -> Value:
        if isinstance(node, NumberLiteral):
            return float(node.val)
        if isinstance(node, ParenExpr):
            return self.eval(node.expr)
        if isinstance(node, UnaryExpr):  # always a minus: the library drops a unary plus
            inner = self.eval(node.expr)
            if isinstance(inner, float):
                return -inner
            return [Sample(_drop(s.labels, NAME), -s.value) for s in inner]
        if isinstance(node, VectorSelector):
            return self._instant(node)
        if isinstance(node, MatrixSelector):
            raise UnsupportedExpression(f"range selector {_metric(node.vector_selector)}[...] must be the argument "
                                        "of a *_over_time or rate function")
        if isinstance(node, Call):
            return self._call(node)
        if isinstance(node, AggregateExpr):
            return self._aggregate(node)
        if isinstance(node, BinaryExpr):
            return self._binary(node)
        raise UnsupportedExpression(f"expression node {type(node).__name__}")

    # -- selectors ----------------------------------------------------------------------------
    def _kind(self, metric: str) -> str:
        kind = self.source.kind(metric)
        if kind is None:
            raise UnsupportedExpression(
                f"metric {metric} is not derived from stored probe results, so only Prometheus can evaluate it")
        return kind

    def _instant(self, node: VectorSelector) -> Vector:
        metric, matchers = _metric(node), label_matchers(node)
        if metric in self.recorded:
            return [s for s in self._expand(metric) if _matching(matchers, s.labels)]
        if self._kind(metric) == "counter":
            raise UnsupportedExpression(
                f"counter {metric} as an instant value: its absolute value depends on the collector process' "
                "lifetime; use rate() or increase()")
        out = []
        for series in self.source.gauges(metric):
            if _matching(matchers, series.labels):
                value = series.last_in(self.at - self.lookback_s, self.at)
                if value is not None:
                    out.append(Sample(series.labels, value))
        return out

    def _expand(self, name: str) -> Vector:
        if name in self._expanding:
            raise UnsupportedExpression(f"recording rule {name} refers to itself")
        self._expanding.add(name)
        try:
            out: Vector = []
            for rule in self.recorded[name]:
                for s in self.vector(rule.expr):
                    out.append(Sample(_set(_drop(s.labels, NAME), {NAME: name, **dict(rule.labels)}), s.value))
            return out
        finally:
            self._expanding.discard(name)

    # -- functions ----------------------------------------------------------------------------
    def _call(self, node: Call) -> Value:
        func, args = node.func.name, node.args  # the library has checked the number and types of args
        if func == "time":
            return self.at
        if func in self.RANGE_FUNCTIONS:
            return self._range_call(func, args[0])
        if func == "histogram_quantile":
            q = self._scalar(args[0], "histogram_quantile()'s quantile")
            return self._histogram_quantile(q, self.vector(args[1]))
        if func in {"clamp_min", "clamp_max"}:
            vector, bound = self.vector(args[0]), self._scalar(args[1], f"{func}()'s bound")
            pick = max if func == "clamp_min" else min
            return [Sample(_drop(s.labels, NAME), s.value if math.isnan(s.value) else pick(s.value, bound))
                    for s in vector]
        if func == "abs":
            return [Sample(_drop(s.labels, NAME), abs(s.value)) for s in self.vector(args[0])]
        raise UnsupportedExpression(f"function {func}()")

    def _range_call(self, func: str, arg: Expr) -> Vector:
        if not isinstance(arg, MatrixSelector):
            raise UnsupportedExpression(f"{func}() needs a range selector such as metric[5m] as its argument")
        metric, matchers = _metric(arg.vector_selector), label_matchers(arg.vector_selector)
        if metric in self.recorded:
            raise UnsupportedExpression(
                f"{func}() over recording rule {metric}: the embedded evaluator keeps no recorded history")
        kind = self._kind(metric)
        # A metric is either a gauge or a counter: one of these two lists stays empty.
        gauges: list[GaugeSeries] = []
        counters: list[CounterSeries] = []
        if kind == "gauge":
            gauges = [s for s in self.source.gauges(metric) if _matching(matchers, s.labels)]
        else:
            counters = [s for s in self.source.counters(metric) if _matching(matchers, s.labels)]
        range_s = arg.range.total_seconds()
        start, end = self.at - range_s, self.at
        if func == "absent_over_time":
            present = any(s.window(start, end) for s in gauges) or any(s.any_in(start, end) for s in counters)
            if present:
                return []
            labels = {m.name: m.value for m in matchers if m.op == "=" and m.name != NAME}
            return [Sample(tuple(sorted(labels.items())), 1.0)]
        if func in {"rate", "increase"}:
            if kind != "counter":
                raise UnsupportedExpression(f"{func}() over gauge {metric}")
            out = []
            for counter in counters:
                if counter.exists_at(end):
                    increase = counter.increase(start, end)
                    out.append(Sample(_drop(counter.labels, NAME), increase / range_s if func == "rate" else increase))
            return out
        if kind != "gauge":
            raise UnsupportedExpression(
                f"{func}() over counter {metric}: stored results are events, not scraped samples; "
                "use rate() or increase()")
        reducers: dict[str, Callable[[list[float]], float]] = {
            "avg_over_time": lambda v: math.fsum(v) / len(v), "min_over_time": min, "max_over_time": max,
            "sum_over_time": math.fsum, "count_over_time": lambda v: float(len(v)), "last_over_time": lambda v: v[-1],
        }
        reduce = reducers[func]
        out = []
        for gauge in gauges:
            values = gauge.window(start, end)
            if values:
                out.append(Sample(_drop(gauge.labels, NAME), float(reduce(values))))
        return out

    def _histogram_quantile(self, q: float, vector: Vector) -> Vector:
        groups: dict[Labels, list[tuple[float, float]]] = {}
        for s in vector:
            le = s.label("le")
            if not le:
                continue
            try:
                bound = float(le)
            except ValueError:
                continue
            groups.setdefault(_drop(s.labels, NAME, "le"), []).append((bound, s.value))
        return [Sample(labels, bucket_quantile(q, buckets)) for labels, buckets in groups.items()]

    # -- aggregation and operators --------------------------------------------------------------
    def _aggregate(self, node: AggregateExpr) -> Vector:
        modifier = node.modifier
        without = modifier is not None and modifier.type == AggModifierType.Without
        grouping = tuple(modifier.labels) if modifier is not None else ()
        groups: dict[Labels, list[float]] = {}
        for s in self.vector(node.expr):
            if without:
                key = _drop(s.labels, NAME, *grouping)
            else:
                key = tuple((k, v) for k, v in s.labels if k in grouping and k != NAME)
            groups.setdefault(key, []).append(s.value)
        reduce: Callable[[list[float]], float] = {
            "sum": math.fsum, "avg": lambda v: math.fsum(v) / len(v), "count": lambda v: float(len(v)),
            "min": lambda v: min((x for x in v if not math.isnan(x)), default=math.nan),
            "max": lambda v: max((x for x in v if not math.isnan(x)), default=math.nan),
        }[str(node.op)]
        return [Sample(key, float(reduce(values))) for key, values in groups.items()]

    def _binary(self, node: BinaryExpr) -> Value:
        lhs, rhs = self.eval(node.lhs), self.eval(node.rhs)
        op = str(node.op)
        if op in SET_OPERATORS:
            if not (isinstance(lhs, list) and isinstance(rhs, list)):  # the library rejects these on scalars
                raise UnsupportedExpression(f"{op} needs an instant vector on both sides")
            return _set_operation(op, node.modifier, lhs, rhs)
        is_cmp = op in COMPARISONS
        bool_modifier = node.modifier is not None and node.modifier.return_bool
        if isinstance(lhs, list):
            if isinstance(rhs, list):
                return _vector_vector(op, node.modifier, lhs, rhs)
            vector, scalar, swapped = lhs, rhs, False
        elif isinstance(rhs, list):
            vector, scalar, swapped = rhs, lhs, True
        else:  # two scalars: the library requires bool on a scalar comparison
            return float(_COMPARE[op](lhs, rhs)) if is_cmp else _ARITHMETIC[op](lhs, rhs)
        out = []
        for s in vector:
            a, b = (scalar, s.value) if swapped else (s.value, scalar)
            if is_cmp:
                keep = _COMPARE[op](a, b)
                if bool_modifier:
                    out.append(Sample(_drop(s.labels, NAME), float(keep)))
                elif keep:
                    out.append(s)  # a filter keeps the vector's own value and name
            else:
                out.append(Sample(_drop(s.labels, NAME), _ARITHMETIC[op](a, b)))
        return out


SET_OPERATORS = frozenset({"and", "or", "unless"})


def _signature(labels: Labels, modifier: BinModifier | None) -> Labels:
    """The labels two samples are matched on: all but the name, or only `on(...)`, or all but `ignoring(...)`."""
    matching = modifier.matching if modifier is not None else None
    if matching is None:
        return _drop(labels, NAME)
    names = set(matching.labels)
    if matching.type == LabelModifierType.Include:
        return tuple((k, v) for k, v in labels if k in names)
    return tuple((k, v) for k, v in labels if k not in names and k != NAME)


def _set_operation(op: str, modifier: BinModifier | None, lhs: Vector, rhs: Vector) -> Vector:
    """`and`, `or`, `unless` as Prometheus does them: many-to-many on the matching labels, names kept."""
    right = {_signature(s.labels, modifier) for s in rhs}
    if op == "and":
        return [s for s in lhs if _signature(s.labels, modifier) in right]
    if op == "unless":
        return [s for s in lhs if _signature(s.labels, modifier) not in right]
    left = {_signature(s.labels, modifier) for s in lhs}
    return list(lhs) + [s for s in rhs if _signature(s.labels, modifier) not in left]


def _vector_vector(op: str, modifier: BinModifier | None, lhs: Vector, rhs: Vector) -> Vector:
    """Prometheus' VectorBinop: one-to-one, or many-to-one / one-to-many with group_left / group_right, whose
    listed labels are copied from the "one" side. A comparison without bool keeps the left operand's value."""
    is_cmp = op in COMPARISONS
    bool_modifier = modifier is not None and modifier.return_bool
    card = modifier.card if modifier is not None else None
    one_to_many = card == VectorMatchCardinality.OneToMany
    many_to_one = card == VectorMatchCardinality.ManyToOne
    many, one = (rhs, lhs) if one_to_many else (lhs, rhs)
    index: dict[Labels, Sample] = {}
    for s in one:
        key = _signature(s.labels, modifier)
        if key in index:
            side = "left" if one_to_many else "right"
            raise EvaluationError(f"many-to-many matching not allowed: duplicate series {dict(key)} on the {side} "
                                  "side (matching labels must be unique on one side)")
        index[key] = s
    grouped = one_to_many or many_to_one
    include = list(modifier.group_labels or ()) if grouped and modifier is not None else []
    seen: set[Labels] = set()
    out = []
    for s in many:
        key = _signature(s.labels, modifier)
        other = index.get(key)
        if other is None:
            continue
        left, right = (other, s) if one_to_many else (s, other)
        if is_cmp:
            keep = _COMPARE[op](left.value, right.value)
            if not keep and not bool_modifier:
                continue
            value = float(keep) if bool_modifier else left.value
        else:
            value = _ARITHMETIC[op](left.value, right.value)
        labels = dict(s.labels)  # Prometheus' resultMetric: the "many" side's labels
        if not is_cmp:
            labels.pop(NAME, None)
        matching = modifier.matching if modifier is not None else None
        if not grouped and matching is not None:
            names = set(matching.labels)
            if matching.type == LabelModifierType.Include:
                labels = {k: v for k, v in labels.items() if k in names}
            else:
                labels = {k: v for k, v in labels.items() if k not in names}
        if bool_modifier:
            labels.pop(NAME, None)
        for name in include:
            value_from_one = other.label(name)
            if value_from_one:
                labels[name] = value_from_one
            else:
                labels.pop(name, None)
        result = tuple(sorted(labels.items()))
        if grouped:
            if result in seen:
                raise EvaluationError(f"multiple matches for labels {dict(result)}: grouping labels must ensure "
                                      "unique matches")
            seen.add(result)
        elif key in seen:
            raise EvaluationError(f"many-to-many matching: duplicate series {dict(key)} on the left side")
        else:
            seen.add(key)
        out.append(Sample(result, value))
    return out
