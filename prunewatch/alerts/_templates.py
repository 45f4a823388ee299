"""Render the annotation templates of rules.yml the way Prometheus' Go templates render them.

Supported: `{{ $labels.NAME }}`, `{{ $value }}`, `{{ $value | printf "FMT" }}` and
`{{ printf "FMT" $value }}` with one %d/%f/%e/%g verb. Anything else raises
`UnsupportedTemplate` when the rules are loaded, so a rule whose text the embedded evaluator cannot
write is reported, not posted half-rendered.
"""

from __future__ import annotations

import math
import re
from decimal import Decimal

_ACTION = re.compile(r"\{\{-?\s*(.*?)\s*-?\}\}", re.DOTALL)
_LABEL = re.compile(r"\$labels\.([a-zA-Z_][a-zA-Z0-9_]*)")
_PIPE_PRINTF = re.compile(r'\$value\s*\|\s*printf\s+"([^"]*)"')
_CALL_PRINTF = re.compile(r'printf\s+"([^"]*)"\s+\$value')
_VERB = re.compile(r"%(?P<flags>[-+ 0#]*)(?P<width>\d*)(?:\.(?P<precision>\d+))?(?P<verb>[dfeEgGv])")


class UnsupportedTemplate(ValueError):
    """An annotation uses template syntax the embedded evaluator does not render."""


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


def _printf(fmt: str, value: float) -> str:
    verbs = list(_VERB.finditer(fmt))
    if len(verbs) != 1 or "%" in _VERB.sub("", fmt).replace("%%", ""):
        raise UnsupportedTemplate(f"printf format {fmt!r} must hold exactly one %d, %f, %e, %g or %v verb")
    verb = verbs[0]
    special = _go_special(value)
    if verb.group("verb") == "v":
        text = _go_value(value)
    elif special is not None:
        text = special
    elif verb.group("verb") == "d":
        raise UnsupportedTemplate(f"printf {fmt!r}: %d of a float value prints %!d in Go; use %.0f")
    else:
        spec = verb.group(0)[1:]
        text = format(value, spec)
    return fmt[:verb.start()] + text + fmt[verb.end():].replace("%%", "%")


def render(template: str, labels: dict[str, str], value: float) -> str:
    """Expand `template` for one alert; missing labels render empty, as in Prometheus."""

    def action(match: re.Match[str]) -> str:
        body = match.group(1)
        if label := _LABEL.fullmatch(body):
            return labels.get(label.group(1), "")
        if body == "$value":
            return _go_value(value)
        if fmt := (_PIPE_PRINTF.fullmatch(body) or _CALL_PRINTF.fullmatch(body)):
            return _printf(fmt.group(1), value)
        raise UnsupportedTemplate(f"template action {{{{ {body} }}}} is not supported by the embedded evaluator")

    return _ACTION.sub(action, template)


def check(template: str) -> None:
    """Raise `UnsupportedTemplate` now rather than when the alert fires."""
    render(template, {}, 1.0)
