"""PromQL for the embedded evaluator: promql-parser parses, this module decides what the evaluator runs.

The maintained promql-parser library (Rust; PromQL of Prometheus 2.45) turns text into its AST and
type-checks it, so no PromQL grammar is kept here. `parse` turns the library's errors into
`PromQLSyntaxError` and refuses, naming the construct, valid PromQL the evaluator does not run
(offset, @, subqueries, fill, %, ^, atan2, topk and the other aggregations outside sum/avg/min/max/count,
selectors without a metric name). Vector matching (on/ignoring, group_left/group_right) and the set operators
and/or/unless are evaluated: the rules compare each model with its own thresholds `on(model)`., so a rule the evaluator
cannot run is reported instead of silently skipped.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass

import promql_parser
from promql_parser import (
    AggregateExpr,
    BinaryExpr,
    Call,
    Expr,
    MatchOp,
    MatrixSelector,
    ParenExpr,
    StringLiteral,
    SubqueryExpr,
    UnaryExpr,
    VectorSelector,
)


class PromQLSyntaxError(ValueError):
    """The text is not valid PromQL (the library's reason, with the expression)."""


class UnsupportedExpression(ValueError):
    """Valid PromQL that the embedded evaluator deliberately does not evaluate."""


AGGREGATIONS = frozenset({"sum", "avg", "min", "max", "count"})
COMPARISONS = frozenset({"==", "!=", ">", "<", ">=", "<="})
ARITHMETIC = frozenset({"+", "-", "*", "/"})
_SET_OPERATORS = frozenset({"and", "or", "unless"})
# MatchOp members are not hashable, so the PromQL spelling is looked up by equality.
_MATCH_OPS = ((MatchOp.Equal, "="), (MatchOp.NotEqual, "!="), (MatchOp.Re, "=~"), (MatchOp.NotRe, "!~"))


@dataclass(frozen=True)
class Matcher:
    """A label matcher with PromQL's semantics; Alertmanager's matchers (prunewatch/alerts/inhibit.py) share them."""

    name: str
    op: str  # =, !=, =~, !~
    value: str

    def matches(self, actual: str) -> bool:
        """Whether label value `actual` ("" for a missing label) satisfies the matcher; regexes match whole values."""
        if self.op == "=":
            return actual == self.value
        if self.op == "!=":
            return actual != self.value
        hit = re.fullmatch(self.value, actual) is not None
        return hit if self.op == "=~" else not hit


def label_matchers(selector: VectorSelector) -> tuple[Matcher, ...]:
    """The selector's label matchers (the metric name is not one of them), in a form the evaluator applies.

    The library exposes matchers as data only, without a way to test a label value against them.
    """
    return tuple(Matcher(m.name, next(text for op, text in _MATCH_OPS if m.op == op), m.value)
                 for m in selector.matchers.matchers)


def parse(text: str) -> Expr:
    """Parse `text` into promql-parser's AST, refusing what the embedded evaluator cannot run.

    Raises `PromQLSyntaxError` for invalid PromQL and `UnsupportedExpression` naming the first
    construct outside the evaluator's subset.
    """
    expr = _library_parse(text)
    for node in _nodes(expr):
        construct = _unsupported_construct(node)
        if construct is not None:
            raise UnsupportedExpression(f"{construct} is not supported by the embedded evaluator in {text!r}")
    return expr


def top_level_binary(text: str) -> bool:
    """Whether `text` is a binary operation at its top level (so appending `> x` needs parentheses).

    Asks about syntax only, so it also answers for PromQL the embedded evaluator does not run.
    """
    return isinstance(_library_parse(text), BinaryExpr)


def longest_range(expr: Expr) -> float:
    """The longest range selector in `expr` in seconds (0 without one): how much history evaluating it reads."""
    return max((node.range.total_seconds() for node in _nodes(expr) if isinstance(node, MatrixSelector)),
               default=0.0)


def _nodes(expr: Expr) -> Iterator[Expr]:
    """Every node of `expr`, each before its children, left to right.

    promql_parser.walk visits the same nodes, but its time grows far faster than the tree (here 0.4 s
    for a sum of 100 rate() terms, 11 s for 200), so the tree is walked through the nodes' fields.
    """
    stack = [expr]
    while stack:
        node = stack.pop()
        yield node
        stack.extend(reversed(_children(node)))


def _children(node: Expr) -> list[Expr]:
    if isinstance(node, (ParenExpr, UnaryExpr, SubqueryExpr)):
        return [node.expr]
    if isinstance(node, AggregateExpr):
        return [node.param, node.expr] if node.param is not None else [node.expr]
    if isinstance(node, BinaryExpr):
        return [node.lhs, node.rhs]
    if isinstance(node, Call):
        return list(node.args)
    if isinstance(node, MatrixSelector):
        return [node.vector_selector]
    return []


def _library_parse(text: str) -> Expr:
    try:
        return promql_parser.parse(text)
    except ValueError as exc:  # the library reports every syntax and type error as ValueError, without position
        raise PromQLSyntaxError(f"{exc} in {text!r}") from exc


def _unsupported_construct(node: Expr) -> str | None:
    """What in `node` itself (not in its children, which `_nodes` yields too) the evaluator does not run."""
    if isinstance(node, VectorSelector):
        if node.name is None:
            return "selector without a metric name"
        if node.offset is not None:
            return "modifier 'offset'"
        if node.at is not None:
            return "modifier '@'"
        if node.matchers.or_matchers:
            return "'or' between label matchers"
    elif isinstance(node, SubqueryExpr):
        return "subquery"
    elif isinstance(node, StringLiteral):
        return "string literal"
    elif isinstance(node, AggregateExpr):
        if str(node.op) not in AGGREGATIONS:
            return f"aggregation {str(node.op)!r}"
    elif isinstance(node, BinaryExpr):
        op = str(node.op)
        if op not in COMPARISONS | ARITHMETIC | _SET_OPERATORS:
            return f"operator {op!r}"
        modifier = node.modifier
        if modifier is not None and (modifier.fill_values.lhs is not None or modifier.fill_values.rhs is not None):
            return "modifier 'fill'"
    return None
