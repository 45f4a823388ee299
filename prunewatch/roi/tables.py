"""Tables every surface shows (headline metrics, inputs with provenance, outputs) and their CSV."""

from __future__ import annotations

import csv
import io

from pydantic import BaseModel, ConfigDict

from prunewatch.roi.costs import PERIOD_DAYS, Basis, RoiResult
from prunewatch.roi.formatting import number, payback_text, usd
from prunewatch.roi.measured import MeasuredSummary


class Headline(BaseModel):
    """One headline metric: the label, the formatted value, and how it was obtained."""

    model_config = ConfigDict(frozen=True)

    label: str
    value: str
    help: str


def headlines(result: RoiResult, basis: Basis) -> list[Headline]:
    """The five numbers a CFO reads first, on one cost basis."""
    costs = result.costs(basis)
    how = (f"Before and after pruning, computed on the {basis.value} basis from measured and assumed inputs "
           f"(see the inputs table).")
    pay = result.payback(basis)
    return [
        Headline(label="Cost before / month", value=usd(costs.before_per("month")), help=how),
        Headline(label="Cost after / month", value=usd(costs.after_per("month")),
                 help=how + " " + result.inputs.describe_basis()),
        Headline(label="Savings / month", value=usd(costs.savings_per("month")), help=how),
        Headline(label="Savings / year", value=usd(costs.savings_per("year")), help=how),
        Headline(label="Payback", value=payback_text(pay), help=pay.reason),
    ]


def input_rows(result: RoiResult) -> list[dict[str, str]]:
    """Every input with its value, unit, provenance and note."""
    return [{"Input": item.label, "Value": number(item.value, item.unit), "Unit": item.unit,
             "Provenance": item.provenance.value, "Note": item.note} for item in result.inputs.rows()]


def cost_rows(result: RoiResult, basis: Basis, period: str = "month") -> list[dict[str, str]]:
    """Cost lines before and after pruning, and the change, for one basis and period."""
    costs = result.costs(basis)
    days = PERIOD_DAYS[period]
    rows = []
    for label, name in (("GPU", "gpu_usd"), ("Tokens", "token_usd"), ("Failures", "failure_usd")):
        before, after = getattr(costs.before, name) * days, getattr(costs.after, name) * days
        rows.append({"Line": label, "Before": usd(before), "After": usd(after), "Savings": usd(before - after)})
    rows.append({"Line": "Total", "Before": usd(costs.before_per(period)), "After": usd(costs.after_per(period)),
                 "Savings": usd(costs.savings_per(period))})
    return rows


def to_csv(result: RoiResult, summary: MeasuredSummary) -> str:
    """Inputs (with provenance) and outputs on both bases and all periods, as one CSV."""
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(["section", "name", "value", "unit", "provenance_or_basis", "note"])
    writer.writerow(["window", "start", summary.window.start.isoformat(), "UTC", "selected", ""])
    writer.writerow(["window", "end", summary.window.end.isoformat(), "UTC", "selected", ""])
    writer.writerow(["window", "target", summary.target or "all", "", "selected", ""])
    for item in result.inputs.rows():
        writer.writerow(["input", item.key, repr(item.value), item.unit, item.provenance.value, item.note])
    times = result.gpu_time
    writer.writerow(["output", "gpu_s_per_request_before", repr(times.before_s), "s/request",
                     times.before_provenance.value, ""])
    writer.writerow(["output", "gpu_s_per_request_after", repr(times.after_s), "s/request",
                     times.after_provenance.value, result.inputs.describe_basis()])
    for basis in Basis:
        costs = result.costs(basis)
        for period in ("day", "month", "year"):
            for name, value in (("cost_before", costs.before_per(period)), ("cost_after", costs.after_per(period)),
                                ("savings", costs.savings_per(period))):
                writer.writerow(["output", f"{name}_per_{period}", f"{value:.2f}", "$", basis.value, ""])
        pay = result.payback(basis)
        writer.writerow(["output", "payback_days", "" if pay.days is None else f"{pay.days:.1f}", "days",
                         basis.value, pay.reason])
    return buffer.getvalue()
