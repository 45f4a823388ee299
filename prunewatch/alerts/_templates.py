"""Render the annotation templates of rules.yml the way Prometheus' Go templates render them.

Supported, with Go's semantics:
- text and actions `{{ PIPELINE }}` (trim markers `{{-` / `-}}` included);
- `{{ with PIPELINE }} ... {{ else }} ... {{ end }}` (the body sees the pipeline's value as `.`);
- pipelines of commands joined by `|`, each command's result passed as the last argument of the next;
- operands `$labels.NAME`, `$value`, `.`, "strings" and numbers;
- functions `printf` (verbs %s %v %d %f %e %g %q, width and precision, %%), `query` (a PromQL instant
  query over the same data the rule was evaluated on), `first`, `value`, `label`.

So an annotation can quote what its alert compared with, e.g. a model's measured threshold:
`{{ with printf "prunewatch_alert_threshold{model='%s',kind='ratio_low'}" $labels.model | query }}{{ . | first
| value | printf "%.3f" }}{{ else }}none{{ end }}`. Anything else raises `UnsupportedTemplate` when the rules
are loaded, so a rule whose text the embedded evaluator cannot write is reported, not posted half-rendered.
A template that fails while rendering (e.g. `first` of an empty result) renders as Prometheus does:
`<error expanding template: ...>`.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

_ACTION = re.compile(r"\{\{(-\s)?\s*(.*?)\s*(\s-)?\}\}", re.DOTALL)
_VERB = re.compile(r"%(?P<flags>[-+ 0#]*)(?P<width>\d*)(?:\.(?P<precision>\d+))?(?P<verb>[sdfeEgGvq%])")
_TOKEN = re.compile(r'\s*(?:(?P<string>"(?:[^"\\]|\\.)*")|(?P<number>-?\d+(?:\.\d+)?)|(?P<pipe>\|)'
                    r"|(?P<labels>\$labels\.[a-zA-Z_][a-zA-Z0-9_]*)|(?P<value>\$value)|(?P<dot>\.)"
                    r"|(?P<ident>[a-zA-Z_][a-zA-Z0-9_]*))")
FUNCTIONS = frozenset({"printf", "query", "first", "value", "label"})

QueryResult = Sequence[Any]  # samples with `.labels` (pairs) and `.value`
Query = Callable[[str], QueryResult]


class UnsupportedTemplate(ValueError):
    """An annotation uses template syntax the embedded evaluator does not render."""


class TemplateError(ValueError):
    """A supported template failed while rendering (Prometheus writes `<error expanding template: ...>`)."""


# -- parsing ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Operand:
    kind: str  # string, number, labels, value, dot
    text: str


@dataclass(frozen=True)
class Command:
    function: str | None  # None: a lone operand
    args: tuple[Operand, ...]


@dataclass(frozen=True)
class Pipeline:
    commands: tuple[Command, ...]


@dataclass(frozen=True)
class With:
    pipeline: Pipeline
    body: tuple[Any, ...]
    otherwise: tuple[Any, ...]


def _parse_pipeline(text: str) -> Pipeline:
    commands: list[Command] = []
    words: list[tuple[str, str]] = []
    position = 0
    tokens: list[tuple[str, str]] = []
    while position < len(text):
        match = _TOKEN.match(text, position)
        if match is None or match.end() == position:
            raise UnsupportedTemplate(f"template action {{{{ {text} }}}} is not supported by the embedded evaluator")
        position = match.end()
        kind = match.lastgroup or ""
        tokens.append((kind, match.group(kind)))
    tokens.append(("pipe", "|"))
    for kind, value in tokens:
        if kind != "pipe":
            words.append((kind, value))
            continue
        if not words:
            raise UnsupportedTemplate(f"empty command in template action {{{{ {text} }}}}")
        first_kind, first = words[0]
        if first_kind == "ident":
            if first not in FUNCTIONS:
                raise UnsupportedTemplate(f"template function {first!r} is not supported by the embedded evaluator")
            args = words[1:]
            function: str | None = first
        else:
            if len(words) != 1:
                raise UnsupportedTemplate(f"template action {{{{ {text} }}}} is not supported by the embedded evaluator")
            args, function = words, None
        if any(k == "ident" for k, _ in args):
            raise UnsupportedTemplate(f"template action {{{{ {text} }}}}: nested function calls are not supported")
        commands.append(Command(function, tuple(Operand(k, v) for k, v in args)))
        words = []
    return Pipeline(tuple(commands))


def parse(template: str) -> tuple[Any, ...]:
    """The template as a tree of text pieces, pipelines and `with` blocks; raises UnsupportedTemplate."""
    stack: list[tuple[list[Any], Pipeline | None, list[Any] | None]] = [([], None, None)]
    position = 0
    for match in _ACTION.finditer(template):
        text = template[position:match.start()]
        if match.group(1):  # {{- trims the whitespace before
            text = text.rstrip()
        current = stack[-1][2] if stack[-1][2] is not None else stack[-1][0]
        if text:
            current.append(text)
        position = match.end()
        if match.group(3):  # -}} trims the whitespace after
            rest = template[position:]
            position += len(rest) - len(rest.lstrip())
        body = match.group(2)
        word = body.split(None, 1)[0] if body.split() else ""
        if word == "with":
            stack.append(([], _parse_pipeline(body[4:].strip()), None))
        elif word == "else" and body == "else":
            if len(stack) == 1 or stack[-1][2] is not None:
                raise UnsupportedTemplate("{{ else }} outside a {{ with }} block")
            stack[-1] = (stack[-1][0], stack[-1][1], [])
        elif word == "end" and body == "end":
            if len(stack) == 1:
                raise UnsupportedTemplate("{{ end }} without a {{ with }}")
            then, pipeline, otherwise = stack.pop()
            node = With(pipeline, tuple(then), tuple(otherwise or ()))  # type: ignore[arg-type]
            (stack[-1][2] if stack[-1][2] is not None else stack[-1][0]).append(node)
        elif word in ("if", "range", "define", "template", "block") or body.startswith("/*"):
            raise UnsupportedTemplate(f"template action {{{{ {body} }}}} is not supported by the embedded evaluator")
        else:
            current = stack[-1][2] if stack[-1][2] is not None else stack[-1][0]
            current.append(_parse_pipeline(body))
    if len(stack) != 1:
        raise UnsupportedTemplate("{{ with }} without its {{ end }}")
    tail = template[position:]
    if tail:
        stack[0][0].append(tail)
    return tuple(stack[0][0])


# -- values -------------------------------------------------------------------------------------------
def _go_special(value: float) -> str | None:
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return None


def _go_value(value: float) -> str:
    """Go's %v of a float64: strconv 'g' with the shortest digits, exponent form below 1e-4 or from 1e6."""
    special = _go_special(value)
    if special is not None:
        return special
    if value == 0:
        return "0"
    number = Decimal(repr(float(value)))
    sign, digits, _ = number.as_tuple()
    exponent = number.adjusted()
    text = "".join(map(str, digits)).rstrip("0") or "0"
    if exponent < -4 or exponent >= 6:
        mantissa = text[0] + ("." + text[1:] if len(text) > 1 else "")
        return f"{'-' if sign else ''}{mantissa}e{'-' if exponent < 0 else '+'}{abs(exponent):02d}"
    return format(number.normalize(), "f")


def _text(value: Any) -> str:
    """How Go's template prints a value."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return _go_value(float(value))
    if value is None:
        return "<no value>"
    return str(value)


def _format_one(verb: re.Match[str], value: Any) -> str:
    letter = verb.group("verb")
    spec = verb.group(0)[1:-1]
    if letter in "sq" or (letter == "v" and isinstance(value, str)):
        text = _text(value)
        if letter == "q":
            text = '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'
        flags, width = verb.group("flags"), verb.group("width")
        if width:
            text = text.ljust(int(width)) if "-" in flags else text.rjust(int(width))
        return text
    if not isinstance(value, (int, float)):
        return f"%!{letter}({type(value).__name__}={value})"
    number = float(value)
    if letter == "v":
        return _go_value(number)
    special = _go_special(number)
    if special is not None:
        return special
    if letter == "d":
        if isinstance(value, float):
            raise UnsupportedTemplate(f"printf %d of a float value prints %!d in Go; use %.0f ({verb.group(0)!r})")
        return format(int(value), spec + "d")
    return format(number, spec + letter)


def go_printf(fmt: str, args: Sequence[Any]) -> str:
    """Go's fmt.Sprintf for the verbs in the module docstring."""
    out: list[str] = []
    position, used = 0, 0
    for verb in _VERB.finditer(fmt):
        out.append(fmt[position:verb.start()])
        position = verb.end()
        if verb.group("verb") == "%":
            out.append("%")
            continue
        if used >= len(args):
            out.append(f"%!{verb.group('verb')}(MISSING)")
            continue
        out.append(_format_one(verb, args[used]))
        used += 1
    out.append(fmt[position:])
    if "%" in _VERB.sub("", fmt):
        raise UnsupportedTemplate(f"printf format {fmt!r} has a verb the embedded evaluator does not render")
    return "".join(out)


@dataclass
class _Context:
    labels: dict[str, str]
    value: float
    query: Query | None


def _unquote(text: str) -> str:
    return bytes(text[1:-1], "utf-8").decode("unicode_escape")


def _operand(op: Operand, ctx: _Context, dot: Any) -> Any:
    if op.kind == "string":
        return _unquote(op.text)
    if op.kind == "number":
        return float(op.text) if "." in op.text else int(op.text)
    if op.kind == "labels":
        return ctx.labels.get(op.text.split(".", 1)[1], "")
    if op.kind == "value":
        return ctx.value
    return dot


def _call(command: Command, ctx: _Context, dot: Any, piped: list[Any]) -> Any:
    args = [_operand(a, ctx, dot) for a in command.args] + piped
    name = command.function
    if name is None:
        return args[0]
    if name == "printf":
        if not args or not isinstance(args[0], str):
            raise TemplateError("printf needs a format string")
        return go_printf(args[0], args[1:])
    if name == "query":
        if len(args) != 1 or not isinstance(args[0], str):
            raise TemplateError("query needs one PromQL string")
        if ctx.query is None:
            return []
        try:
            return list(ctx.query(args[0]))
        except ValueError as exc:
            raise TemplateError(f"error executing query: {exc}") from exc
    if name == "first":
        if len(args) != 1 or not isinstance(args[0], (list, tuple)):
            raise TemplateError("first needs a query result")
        if not args[0]:
            raise TemplateError("first() called on vector with no elements")
        return args[0][0]
    if name == "value":
        if len(args) != 1 or not hasattr(args[0], "value"):
            raise TemplateError("value needs a sample")
        return float(args[0].value)
    if name == "label":
        if len(args) != 2 or not isinstance(args[0], str) or not hasattr(args[1], "labels"):
            raise TemplateError('label needs a label name and a sample: label "name"')
        return dict(args[1].labels).get(args[0], "")
    raise UnsupportedTemplate(f"template function {name!r}")  # parse refuses it first


def _pipeline(pipeline: Pipeline, ctx: _Context, dot: Any) -> Any:
    result: list[Any] = []
    for command in pipeline.commands:
        result = [_call(command, ctx, dot, result)]
    return result[0]


def _truthy(value: Any) -> bool:
    if isinstance(value, (list, tuple, str, dict)):
        return len(value) > 0
    if isinstance(value, (int, float)):
        return value != 0
    return value is not None


def _render_nodes(nodes: Sequence[Any], ctx: _Context, dot: Any) -> str:
    out: list[str] = []
    for node in nodes:
        if isinstance(node, str):
            out.append(node)
        elif isinstance(node, Pipeline):
            out.append(_text(_pipeline(node, ctx, dot)))
        else:
            value = _pipeline(node.pipeline, ctx, dot)
            out.append(_render_nodes(node.body, ctx, value) if _truthy(value) else
                       _render_nodes(node.otherwise, ctx, dot))
    return "".join(out)


def render(template: str, labels: dict[str, str], value: float, query: Query | None = None) -> str:
    """Expand `template` for one alert; missing labels render empty, as in Prometheus. `query` runs a template's
    PromQL (None: every query returns nothing)."""
    nodes = parse(template)
    try:
        return _render_nodes(nodes, _Context(labels, value, query), None)
    except TemplateError as exc:
        return f"<error expanding template: {exc}>"


def check(template: str) -> None:
    """Raise `UnsupportedTemplate` now rather than when the alert fires."""
    nodes = parse(template)
    _check_nodes(nodes)
    render(template, {}, 1.0)


def _check_nodes(nodes: Sequence[Any]) -> None:
    for node in nodes:
        if isinstance(node, Pipeline):
            _check_pipeline(node)
        elif isinstance(node, With):
            _check_pipeline(node.pipeline)
            _check_nodes(node.body)
            _check_nodes(node.otherwise)


def _check_pipeline(pipeline: Pipeline) -> None:
    for command in pipeline.commands:
        if command.function == "printf" and command.args and command.args[0].kind == "string":
            fmt = _unquote(command.args[0].text)
            go_printf(fmt, [1.0] * fmt.count("%"))  # refuses verbs it cannot render
