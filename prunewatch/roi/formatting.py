"""Number formatting shared by the app, the CSV and the report, so every surface prints the same text."""

from __future__ import annotations

from prunewatch.roi.costs import Payback


def usd(value: float) -> str:
    """Dollars: cents below $100, whole dollars above; ASCII minus so text extraction finds it."""
    sign = "-" if value < 0 else ""
    magnitude = abs(value)
    if magnitude < 100:
        return f"{sign}${magnitude:,.2f}"
    return f"{sign}${magnitude:,.0f}"


def pct(fraction: float, digits: int = 1) -> str:
    return f"{fraction * 100:.{digits}f}%"


def interval_text(interval: dict[str, float], unit: str = "prompts") -> str:
    """A share with its 95% interval and evidence: '93.1% [90.2%, 95.4%] over 21 prompts'."""
    prompts = int(interval["prompts"])
    text = f"{pct(interval['estimate'])} [{pct(interval['low'])}, {pct(interval['high'])}] over {prompts} prompts"
    if unit == "answers":
        text += f" ({int(interval['tokens'])} answers)"
    return text


def number(value: float, unit: str) -> str:
    """An input's value in its unit's natural precision."""
    if unit.startswith("$"):
        return usd(value) if unit != "$/1M tokens" else f"${value:,.2f}"
    if unit == "fraction":
        return pct(value)
    if unit in ("requests/day",):
        return f"{value:,.0f}"
    if unit in ("tokens",):
        return f"{value:,.1f}"
    if unit in ("s/request",):
        return f"{value:.3f} s"
    if unit == "clients":
        return f"{value:.0f}"
    if unit == "tokens/s":
        return f"{value:.1f}"
    return f"{value:.3f}"


def payback_text(payback: Payback) -> str:
    if payback.days is None:
        return "no payback"
    if payback.days == 0:
        return "immediate"
    months = payback.months or 0.0
    if months < 1:
        return f"{payback.days:.0f} days"
    return f"{months:.1f} months"
