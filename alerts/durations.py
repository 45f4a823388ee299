"""Prometheus duration strings ("2h", "1h30m", "90s") as typed `timedelta` settings.

Thresholds are written by people in Prometheus' own notation and rendered back into rules.yml
in it, so the rule file reads exactly like the setting that produced it.
"""

from __future__ import annotations

import re
from datetime import timedelta
from typing import Annotated, Any

from pydantic import BeforeValidator, PlainSerializer

_UNITS_MS = {"y": 365 * 86_400_000, "w": 7 * 86_400_000, "d": 86_400_000, "h": 3_600_000, "m": 60_000,
             "s": 1000, "ms": 1}
_ORDER = ("y", "w", "d", "h", "m", "s", "ms")
_PART = re.compile(r"(\d+)(ms|y|w|d|h|m|s)")


def parse_duration(text: str) -> timedelta:
    """Parse a Prometheus duration; units must appear largest first, each at most once."""
    value = text.strip()
    if not value:
        raise ValueError("empty duration")
    position, total_ms, last_rank = 0, 0, -1
    for match in _PART.finditer(value):
        if match.start() != position:
            break
        rank = _ORDER.index(match.group(2))
        if rank <= last_rank:
            raise ValueError(f"duration {text!r}: units must go from largest to smallest, each once")
        last_rank = rank
        total_ms += int(match.group(1)) * _UNITS_MS[match.group(2)]
        position = match.end()
    if position != len(value):
        raise ValueError(f"duration {text!r} is not a Prometheus duration such as 90s, 15m, 2h or 1h30m")
    return timedelta(milliseconds=total_ms)


def format_duration(value: timedelta) -> str:
    """The shortest Prometheus spelling of `value` ("2h", "1h30m", "0s"); weeks and years are not used."""
    total_ms = round(value.total_seconds() * 1000)
    if total_ms < 0:
        raise ValueError(f"negative duration {value}")
    if total_ms == 0:
        return "0s"
    parts = []
    for unit in ("d", "h", "m", "s", "ms"):
        count, total_ms = divmod(total_ms, _UNITS_MS[unit])
        if count:
            parts.append(f"{count}{unit}")
    return "".join(parts)


def _coerce(value: Any) -> Any:
    if isinstance(value, str):
        return parse_duration(value)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return timedelta(seconds=value)
    return value


PromDuration = Annotated[timedelta, BeforeValidator(_coerce), PlainSerializer(format_duration, return_type=str)]
"""A `timedelta` that accepts "15m"-style strings or seconds and serialises back to "15m"."""
