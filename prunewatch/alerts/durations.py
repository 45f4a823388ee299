"""Prometheus duration strings ("2h", "1h30m", "90s") as typed `timedelta` settings.

Thresholds are written by people in Prometheus' own notation and rendered back into rules.yml
in it, so the rule file reads exactly like the setting that produced it. promql-parser reads and
writes the notation; only the two spellings where its PromQL reading differs from the one
Prometheus applies to rule files (`for:`) are handled here.
"""

from __future__ import annotations

import re
from datetime import timedelta
from typing import Annotated, Any

import promql_parser
from pydantic import BeforeValidator, PlainSerializer

_NUMBER = re.compile(r"[0-9]+")


def parse_duration(text: str) -> timedelta:
    """Parse a Prometheus duration ("90s", "15m", "1h30m"); units go largest first, each at most once.

    Two spellings are decided here because promql-parser reads them as PromQL 3 does, not as
    Prometheus reads a rule file: a zero ("0", "0s", the default `for:`) is a valid hold time,
    which the library refuses, and a bare number ("90") is refused, which the library reads as seconds.
    """
    value = text.strip()
    numbers = _NUMBER.findall(value)
    if numbers and not any(int(n) for n in numbers):
        _library_duration(_NUMBER.sub("1", value), text)  # the same spelling with ones checks the units
        return timedelta(0)
    if _NUMBER.fullmatch(value):
        raise ValueError(f"duration {text!r} needs a unit, as in 90s, 15m, 2h or 1h30m")
    return _library_duration(value, text)


def _library_duration(value: str, text: str) -> timedelta:
    try:
        return promql_parser.parse_duration(value)
    except ValueError as exc:
        raise ValueError(f"duration {text!r} is not a Prometheus duration such as 90s, 15m, 2h or 1h30m "
                         f"({exc})") from exc


def format_duration(value: timedelta) -> str:
    """The Prometheus spelling of `value` ("2h", "1h30m", "1w", "0s"), to the millisecond."""
    if value < timedelta(0):
        raise ValueError(f"negative duration {value}")
    return promql_parser.display_duration(timedelta(milliseconds=round(value.total_seconds() * 1000)))


def _coerce(value: Any) -> Any:
    if isinstance(value, str):
        return parse_duration(value)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return timedelta(seconds=value)
    return value


PromDuration = Annotated[timedelta, BeforeValidator(_coerce), PlainSerializer(format_duration, return_type=str)]
"""A `timedelta` that accepts "15m"-style strings or seconds and serialises back to "15m"."""
