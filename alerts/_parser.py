"""A parser for the PromQL subset the embedded evaluator can run, with errors that name the spot.

Anything outside the subset (offset, @, subqueries, on/ignoring/group_left, set operators, ^ and %)
raises `PromQLSyntaxError` or `UnsupportedExpression` with the expression and position, so a rule the
evaluator cannot run is reported instead of silently skipped.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from alerts.durations import parse_duration


class PromQLSyntaxError(ValueError):
    """The text is not PromQL this parser understands."""


class UnsupportedExpression(ValueError):
    """Valid PromQL that the embedded evaluator deliberately does not evaluate."""


AGGREGATIONS = frozenset({"sum", "avg", "min", "max", "count"})
_UNSUPPORTED_AGGREGATIONS = frozenset({"topk", "bottomk", "quantile", "stddev", "stdvar", "count_values", "group"})
COMPARISONS = frozenset({"==", "!=", ">", "<", ">=", "<="})
_PRECEDENCE = {"==": 1, "!=": 1, ">": 1, "<": 1, ">=": 1, "<=": 1, "+": 2, "-": 2, "*": 3, "/": 3}

_TOKEN = re.compile(r"""
    (?P<space>\s+)
  | (?P<duration>\d+(?:ms|[ywdhms])(?:\d+(?:ms|[ywdhms]))*(?![a-zA-Z0-9_]))
  | (?P<number>(?:\d+\.\d*|\.\d+|\d+)(?:[eE][-+]?\d+)?(?![a-zA-Z_:]))
  | (?P<ident>[a-zA-Z_:][a-zA-Z0-9_:]*)
  | (?P<string>"(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*')
  | (?P<op>==|!=|>=|<=|=~|!~|[-+*/%^<>=(){}\[\],@])
""", re.VERBOSE)


@dataclass(frozen=True)
class Token:
    kind: str
    text: str
    pos: int


# -- syntax tree ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Node:
    pass


@dataclass(frozen=True)
class NumberLiteral(Node):
    value: float


@dataclass(frozen=True)
class Matcher:
    name: str
    op: str  # =, !=, =~, !~
    value: str

    def matches(self, actual: str) -> bool:
        if self.op == "=":
            return actual == self.value
        if self.op == "!=":
            return actual != self.value
        hit = re.fullmatch(self.value, actual) is not None
        return hit if self.op == "=~" else not hit


@dataclass(frozen=True)
class Selector(Node):
    metric: str
    matchers: tuple[Matcher, ...] = ()
    range_s: float | None = None  # set for a range selector `metric[5m]`


@dataclass(frozen=True)
class Call(Node):
    func: str
    args: tuple[Node, ...]


@dataclass(frozen=True)
class Aggregate(Node):
    op: str
    expr: Node
    grouping: tuple[str, ...] = ()
    without: bool = False


@dataclass(frozen=True)
class Binary(Node):
    op: str
    lhs: Node
    rhs: Node
    bool_modifier: bool = False


@dataclass(frozen=True)
class Negate(Node):
    expr: Node


@dataclass(frozen=True)
class Paren(Node):
    expr: Node


@dataclass
class _Stream:
    text: str
    tokens: list[Token]
    index: int = 0
    _eof: Token = field(init=False)

    def __post_init__(self) -> None:
        self._eof = Token("eof", "", len(self.text))

    def peek(self, ahead: int = 0) -> Token:
        i = self.index + ahead
        return self.tokens[i] if i < len(self.tokens) else self._eof

    def take(self) -> Token:
        token = self.peek()
        self.index += 1
        return token

    def expect(self, text: str) -> Token:
        token = self.take()
        if token.text != text:
            raise self.error(token, f"expected {text!r}")
        return token

    def error(self, token: Token, message: str) -> PromQLSyntaxError:
        found = "end of expression" if token.kind == "eof" else repr(token.text)
        return PromQLSyntaxError(f"{message} at position {token.pos} (found {found}) in {self.text!r}")

    def unsupported(self, token: Token, what: str) -> UnsupportedExpression:
        return UnsupportedExpression(f"{what} (position {token.pos}) is not supported by the embedded evaluator "
                                     f"in {self.text!r}")


def _tokenize(text: str) -> list[Token]:
    tokens: list[Token] = []
    position = 0
    while position < len(text):
        match = _TOKEN.match(text, position)
        if match is None:
            raise PromQLSyntaxError(f"unexpected character {text[position]!r} at position {position} in {text!r}")
        kind = match.lastgroup or ""
        if kind != "space":
            tokens.append(Token(kind, match.group(), position))
        position = match.end()
    return tokens


def parse(text: str) -> Node:
    """Parse `text` into a syntax tree, or raise with the position of the first problem."""
    stream = _Stream(text, _tokenize(text))
    node = _expression(stream, 0)
    if stream.peek().kind != "eof":
        raise stream.error(stream.peek(), "unexpected token")
    return node


def _expression(stream: _Stream, min_precedence: int) -> Node:
    lhs = _unary(stream)
    while True:
        token = stream.peek()
        if token.kind == "ident" and token.text in {"and", "or", "unless"}:
            raise stream.unsupported(token, f"set operator {token.text!r}")
        if token.text in {"%", "^"} or (token.kind == "ident" and token.text == "atan2"):
            raise stream.unsupported(token, f"operator {token.text!r}")
        precedence = _PRECEDENCE.get(token.text) if token.kind == "op" else None
        if precedence is None or precedence < min_precedence:
            return lhs
        stream.take()
        bool_modifier = False
        if stream.peek().kind == "ident" and stream.peek().text == "bool":
            if token.text not in COMPARISONS:
                raise stream.error(stream.peek(), "bool modifier only applies to comparisons")
            stream.take()
            bool_modifier = True
        if stream.peek().kind == "ident" and stream.peek().text in {"on", "ignoring", "group_left", "group_right"}:
            raise stream.unsupported(stream.peek(), f"vector matching modifier {stream.peek().text!r}")
        rhs = _expression(stream, precedence + 1)  # all supported operators are left-associative
        lhs = Binary(token.text, lhs, rhs, bool_modifier)


def _unary(stream: _Stream) -> Node:
    token = stream.peek()
    if token.text in {"-", "+"} and token.kind == "op":
        stream.take()
        inner = _unary(stream)
        return Negate(inner) if token.text == "-" else inner
    node = _primary(stream)
    after = stream.peek()
    if (after.kind == "ident" and after.text == "offset") or after.text == "@":
        raise stream.unsupported(after, f"modifier {after.text!r}")
    return node


def _primary(stream: _Stream) -> Node:
    token = stream.take()
    if token.kind == "number":
        return NumberLiteral(float(token.text))
    if token.text == "(":
        inner = _expression(stream, 0)
        stream.expect(")")
        if stream.peek().text == "[":
            raise stream.unsupported(stream.peek(), "subquery")
        return Paren(inner)
    if token.text == "{":
        raise stream.unsupported(token, "selector without a metric name")
    if token.kind != "ident":
        raise stream.error(token, "expected a number, a metric, a function or '('")
    name = token.text
    if name in _UNSUPPORTED_AGGREGATIONS:
        raise stream.unsupported(token, f"aggregation {name!r}")
    if name in AGGREGATIONS and stream.peek().text in {"(", "by", "without"}:
        return _aggregate(stream, name)
    if stream.peek().text == "(":
        stream.take()
        args: list[Node] = []
        if stream.peek().text != ")":
            while True:
                args.append(_expression(stream, 0))
                if stream.peek().text != ",":
                    break
                stream.take()
        stream.expect(")")
        return Call(name, tuple(args))
    return _selector(stream, name)


def _grouping(stream: _Stream) -> tuple[str, ...]:
    stream.expect("(")
    labels: list[str] = []
    while stream.peek().text != ")":
        label = stream.take()
        if label.kind != "ident":
            raise stream.error(label, "expected a label name")
        labels.append(label.text)
        if stream.peek().text == ",":
            stream.take()
    stream.expect(")")
    return tuple(labels)


def _aggregate(stream: _Stream, op: str) -> Aggregate:
    grouping: tuple[str, ...] = ()
    without = False
    if stream.peek().text in {"by", "without"}:
        without = stream.take().text == "without"
        grouping = _grouping(stream)
    stream.expect("(")
    expr = _expression(stream, 0)
    if stream.peek().text == ",":
        raise stream.unsupported(stream.peek(), f"parameter of aggregation {op!r}")
    stream.expect(")")
    if stream.peek().text in {"by", "without"}:
        if grouping:
            raise stream.error(stream.peek(), "grouping given twice")
        without = stream.take().text == "without"
        grouping = _grouping(stream)
    return Aggregate(op, expr, grouping, without)


def _selector(stream: _Stream, metric: str) -> Selector:
    matchers: list[Matcher] = []
    if stream.peek().text == "{":
        stream.take()
        while stream.peek().text != "}":
            label = stream.take()
            if label.kind != "ident":
                raise stream.error(label, "expected a label name")
            op = stream.take()
            if op.text not in {"=", "!=", "=~", "!~"}:
                raise stream.error(op, "expected a label matcher operator")
            value = stream.take()
            if value.kind != "string":
                raise stream.error(value, "expected a quoted label value")
            matchers.append(Matcher(label.text, op.text, _unquote(value.text)))
            if stream.peek().text == ",":
                stream.take()
        stream.expect("}")
    range_s = None
    if stream.peek().text == "[":
        stream.take()
        duration = stream.take()
        if duration.kind not in {"duration"}:
            raise stream.error(duration, "expected a duration such as 5m")
        if stream.peek().text.startswith(":"):
            raise stream.unsupported(stream.peek(), "subquery")
        stream.expect("]")
        range_s = parse_duration(duration.text).total_seconds()
    return Selector(metric, tuple(matchers), range_s)


def _unquote(text: str) -> str:
    body = text[1:-1]
    return re.sub(r"\\(.)", lambda m: {"n": "\n", "t": "\t"}.get(m.group(1), m.group(1)), body)


def top_level_binary(text: str) -> bool:
    """Whether `text` is a binary operation at its top level (so appending `> x` needs parentheses)."""
    return isinstance(parse(text), Binary)
