"""Tables every surface shows (headline metrics, inputs with provenance, outputs) and their CSV."""

from __future__ import annotations

import csv
import io
import re

from pydantic import BaseModel, ConfigDict

from prunewatch.roi.costs import PERIOD_DAYS, Basis, RoiResult
from prunewatch.roi.formatting import interval_text, number, payback_text, pct, usd
from prunewatch.roi.load_profile import LoadPoint, clients_text
from prunewatch.roi.measured import MeasuredSummary
from prunewatch.roi.provenance import InputValue, Provenance


class Headline(BaseModel):
    """One headline metric: the label, the formatted value, and how it was obtained."""

    model_config = ConfigDict(frozen=True)

    label: str
    value: str
    help: str


def in_measured_words(text: str, summary: MeasuredSummary, provenance: str = Provenance.MEASURED.value) -> str:
    """A core text ('GPU time after / before', the basis sentence) saying what was really measured.

    The cost model calls every time per request GPU time; a figure read from (or derived from) probes
    that did not run on a GPU says 'CPU time' (or 'time' when the devices are mixed or unrecorded).
    User-entered and default figures keep their words.
    """
    if summary.measured_on_gpu or provenance not in (Provenance.MEASURED.value, Provenance.ESTIMATED.value):
        return text
    noun = summary.time_noun
    return re.sub(r"GPU time", lambda m: noun if m.start() == 0 or noun != "Time" else "time", text)


def basis_text(summary: MeasuredSummary, result: RoiResult) -> str:
    """How 'after' relates to 'before', in the words of what the anchor time was measured on."""
    before = result.inputs.dense_inference_s
    entered = before is not None and before.provenance is Provenance.USER_ENTERED
    return in_measured_words(result.inputs.describe_basis(), summary,
                       Provenance.USER_ENTERED.value if entered else Provenance.MEASURED.value)


def headlines(result: RoiResult, basis: Basis, summary: MeasuredSummary | None = None) -> list[Headline]:
    """The five numbers a CFO reads first, on one cost basis; with the store's summary, the basis is told in the
    words of the device the times were measured on (CPU time for probes that ran on a CPU)."""
    costs = result.costs(basis)
    how = (f"Before and after pruning, computed on the {basis.value} basis from measured and assumed inputs "
           f"(see the inputs table).")
    pay = result.payback(basis)
    return [
        Headline(label="Cost before / month", value=usd(costs.before_per("month")), help=how),
        Headline(label="Cost after / month", value=usd(costs.after_per("month")),
                 help=how + " " + (basis_text(summary, result) if summary else result.inputs.describe_basis())),
        Headline(label="Savings / month", value=usd(costs.savings_per("month")), help=how),
        Headline(label="Savings / year", value=usd(costs.savings_per("year")), help=how),
        Headline(label="Payback", value=payback_text(pay), help=pay.reason),
    ]


def quality_kept_text(summary: MeasuredSummary) -> str:
    """"Quality kept" in one phrase: the reference-scored agreement with its interval and prompts (measured)."""
    if summary.reference_agreement is None:
        return "quality not scored (no served answer was scored by a dense reference)"
    return (f"{interval_text(summary.reference_agreement)} reference-scored agreement of the served answers with "
            "the dense reference")


def quality_rows(summary: MeasuredSummary) -> list[tuple[str, str, str]]:
    """(figure, value, how it was obtained) of the quality the pruned configuration kept, primary figure first."""
    failures = ", ".join(f"{k}: {v}" for k, v in summary.failures_by_reason.items()) or "none"
    rows = [("Reference-scored agreement (quality kept)",
             "not scored" if summary.reference_agreement is None else interval_text(summary.reference_agreement),
             "measured: share of the served answers' tokens equal to the dense reference's argmax given the served "
             "prefix, pooled over prompts; 95% interval bootstrapped over prompts")]
    if summary.pass_rate_pruned is not None or summary.pass_rate_dense is not None:
        rows.append(("Task pass rate, pruned",
                     "n/a" if summary.pass_rate_pruned is None else interval_text(summary.pass_rate_pruned, "answers"),
                     "measured: checked answers that passed their probe's check (number, substring, code run)"))
        rows.append(("Task pass rate, dense",
                     "no dense baseline" if summary.pass_rate_dense is None
                     else interval_text(summary.pass_rate_dense, "answers"),
                     "measured: the dense baseline runs' answers to the same checks"))
    rows.append(("Continuation agreement (secondary)",
                 "n/a" if summary.continuation_agreement_mean is None else pct(summary.continuation_agreement_mean),
                 "measured: pruned vs dense argmax on the dense continuation (teacher-forced, more forgiving); "
                 "full checks of a prunewatch engine only"))
    rows.append(("Mean perplexity change",
                 "n/a" if summary.perplexity_delta_pct_mean is None else f"{summary.perplexity_delta_pct_mean:+.2f}%",
                 "measured: pruned vs dense perplexity of the dense continuation (same full checks)"))
    rows.append(("Failed probe requests", f"{summary.results_failed} of {summary.results_total}",
                 f"measured; by reason: {failures}"))
    return rows


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


def load_rows(load: LoadPoint, hourly: InputValue) -> list[dict[str, str]]:
    """Cost per 1M output tokens, dense vs pruned, at every measured concurrency: where pruning stops paying."""
    rows = []
    for row in load.profile.cost_rows(hourly.value):
        level = row.level
        change = row.pruned_usd_per_mtok / row.dense_usd_per_mtok - 1.0
        rows.append({
            "Concurrent clients": f"{level.clients}" + (" (deployment)" if level.clients == load.concurrency else ""),
            "Dense tokens/s": f"{level.dense_tokens_per_s:.1f}",
            "Pruned tokens/s": f"{level.pruned_tokens_per_s:.1f}",
            "Pruned / dense": f"{level.pruned_vs_dense:.2f}x",
            "Dense $/1M output tokens": f"${row.dense_usd_per_mtok:,.2f}",
            "Pruned $/1M output tokens": f"${row.pruned_usd_per_mtok:,.2f}",
            "Pruning": (f"saves {pct(-change, 0)}" if row.pays else
                        "no change" if change == 0 else f"costs {pct(change, 0)} more"),
        })
    return rows


def load_caption(load: LoadPoint, hourly: InputValue) -> str:
    """How the under-load table was obtained, figure by figure."""
    clients = load.concurrency
    return (f"Tokens/s measured ({load.profile.source}). Cost per 1M output tokens = GPU price / (aggregate "
            f"tokens/s × 3600) × 1e6, at {usd(hourly.value)} per GPU hour ({hourly.provenance.value}), for a server "
            f"kept busy at that concurrency. The deployment's concurrency, {clients_text(clients)}, is "
            f"{load.concurrency_provenance.value}.")


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
    load, hourly = result.inputs.load, result.inputs.gpu_hourly_usd
    if load is not None:
        for row in load.profile.cost_rows(hourly.value):
            for name, value in (("dense", row.dense_usd_per_mtok), ("pruned", row.pruned_usd_per_mtok)):
                writer.writerow(["load", f"{name}_usd_per_mtok_at_{row.level.clients}_clients", f"{value:.4f}",
                                 "$/1M output tokens", Provenance.ESTIMATED.value,
                                 f"GPU price ({hourly.provenance.value}) / measured aggregate tokens/s"])
    return buffer.getvalue()
