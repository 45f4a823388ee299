"""The CFO report: content built once from the core's numbers, rendered to PDF and to HTML.

The content is a list of neutral blocks (headings, paragraphs, tables, charts), so the PDF and
the HTML variant cannot drift apart, and every figure comes from the same functions as the app.
"""

from __future__ import annotations

import html
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime

from prunewatch.records.results import ProbeResult
from prunewatch.roi import report_charts
from prunewatch.roi.analysis import no_sensitivity_text, projection, sensitivity, waterfall
from prunewatch.roi.assumptions import Assumptions
from prunewatch.roi.calculator import calculate
from prunewatch.roi.costs import Basis, RoiResult
from prunewatch.roi.formatting import number, payback_text, pct, usd
from prunewatch.roi.load_profile import LoadPoint, clients_text
from prunewatch.roi.measured import (
    NOT_RECORDED,
    PROBE_MODEL_CAVEAT,
    MeasuredSummary,
    Window,
    scatter_points,
    select,
    trend,
)
from prunewatch.roi.tables import (
    basis_text,
    cost_rows,
    headlines,
    in_measured_words,
    input_rows,
    load_caption,
    load_rows,
    quality_kept_text,
    quality_rows,
)

REPORT_DAYS = (30, 60, 90)
PRIMARY_BASIS = Basis.ALLOCATION  # the honest basis for a CFO comparing with an API price


@dataclass(frozen=True)
class Title:
    text: str
    subtitle: str


@dataclass(frozen=True)
class Heading:
    text: str


@dataclass(frozen=True)
class Para:
    """Text already escaped; may hold <b> and <i> only (valid for both reportlab and HTML)."""

    markup: str
    small: bool = False


@dataclass(frozen=True)
class Bullets:
    items: tuple[str, ...]  # escaped markup, like Para


@dataclass(frozen=True)
class Table:
    header: tuple[str, ...]
    rows: tuple[tuple[str, ...], ...]
    widths: tuple[float, ...]  # fractions of the text width
    bold_last_row: bool = False
    title: str = ""  # kept on the same page as the table


@dataclass(frozen=True)
class Chart:
    png: bytes = field(repr=False)
    caption: str
    width: float = 1.0  # fraction of the text width


@dataclass(frozen=True)
class ChartRow:
    """Two charts side by side, each half the text width."""

    charts: tuple[Chart, Chart]


Block = Title | Heading | Para | Bullets | Table | Chart | ChartRow


@dataclass(frozen=True)
class ReportData:
    """Numbers and content of one report; tests compare its numbers with the core's."""

    days: int
    generated_at: datetime
    summary: MeasuredSummary
    result: RoiResult
    blocks: list[Block]

    @property
    def title(self) -> str:
        return f"Pruning ROI report, last {self.days} days"


def _e(text: object) -> str:
    return html.escape(str(text), quote=False)


def _when(moment: datetime | None) -> str:
    return "n/a" if moment is None else f"{moment.astimezone(UTC):%Y-%m-%d %H:%M} UTC"


def _summary_blocks(summary: MeasuredSummary, result: RoiResult, assumptions: Assumptions) -> list[Block]:
    alloc, usage = result.costs(Basis.ALLOCATION), result.costs(Basis.USAGE)
    pay = result.payback(PRIMARY_BASIS)
    impl = result.inputs.implementation_cost_usd
    if pay.days is None:
        payback_sentence = ("With these inputs the savings do not repay the implementation cost "
                            f"({_e(usd(impl.value))}, {impl.provenance.value}).")
    else:
        payback_sentence = (f"The {_e(usd(impl.value))} implementation cost ({impl.provenance.value}) pays back in "
                            f"<b>{_e(payback_text(pay))}</b> on the allocation basis.")
    where = f"target {summary.target}" if summary.target else "all targets"
    ratio = "n/a" if summary.mean_pruning_ratio is None else pct(summary.mean_pruning_ratio)
    agreement = quality_kept_text(summary)
    volume = result.inputs.requests_per_day
    blocks: list[Block] = [
        Heading("Summary"),
        Para(f"Pruning saves <b>{_e(usd(alloc.savings_per('month')))} per month</b> "
             f"({_e(usd(alloc.savings_per('year')))} per year) on the allocation basis, where GPUs are reserved, and "
             f"{_e(usd(usage.savings_per('month')))} per month ({_e(usd(usage.savings_per('year')))} per year) on the "
             f"usage basis, at {_e(number(volume.value, volume.unit))} requests per day ({volume.provenance.value}). "
             f"{payback_sentence}"),
        Para(f"<b>Evidence.</b> {summary.results_total} probe requests measured on {_e(where)} between "
             f"{_e(_when(summary.first_result_at))} and {_e(_when(summary.last_result_at))}: "
             f"{summary.pruned_results} with pruning, {summary.dense_results} dense baseline, "
             f"{summary.results_failed} failed. Pruning skipped {_e(ratio)} of the work per request on average "
             f"(measured, {_e(summary.ratio_unit or 'no unit')}), and the pruned output kept {_e(agreement)} "
             f"(measured){_e(_pass_rates(summary))}. {_e(_where_timed(summary))}"),
        Para(f"<b>Before and after.</b> {_e(basis_text(summary, result))}"),
    ]
    if summary.uses_probe_model:
        blocks.append(Para(f"<i>{_e(PROBE_MODEL_CAVEAT)}</i>", small=True))
    rows = []
    for alloc_line, usage_line in zip(headlines(result, Basis.ALLOCATION), headlines(result, Basis.USAGE)):
        rows.append((alloc_line.label, alloc_line.value, usage_line.value))
    blocks.append(Table(header=("", "Allocation basis", "Usage basis"), rows=tuple(rows), widths=(0.4, 0.3, 0.3)))
    blocks.append(Para(f"Allocation basis: {_e(Basis.ALLOCATION.description)}. Usage basis: "
                       f"{_e(Basis.USAGE.description)}. A month is 365/12 days. Headline costs include GPU, token "
                       f"and failure costs.", small=True))
    return blocks


def _pass_rates(summary: MeasuredSummary) -> str:
    """', passing its task checks X dense and Y pruned' when checks ran both ways; '' otherwise."""
    if summary.pass_rate_pruned is None or summary.pass_rate_dense is None:
        return ""
    return (f"; its answers passed their task checks {pct(summary.pass_rate_pruned['estimate'])} of the time, "
            f"against {pct(summary.pass_rate_dense['estimate'])} dense (measured, same probes)")


def _where_timed(summary: MeasuredSummary) -> str:
    if summary.measured_on == NOT_RECORDED:
        return "Where the inference times were measured was not recorded."
    return f"Inference times were {summary.measured_on} ({summary.time_noun})."


def _priced_as_gpu_time(summary: MeasuredSummary, load: LoadPoint | None = None) -> str:
    """The caveat when the measured time per request was not measured on a GPU; '' when it was. Under load the
    time comes from the load run, so its machine decides."""
    on_gpu, noun = (load.profile.on_gpu, load.profile.time_noun) if load else (summary.measured_on_gpu,
                                                                                summary.time_noun)
    if on_gpu:
        return ""
    noun = noun if noun != "Time" else "time"
    return (f"The cost lines price this {noun} at the GPU hourly rate as if it were GPU time; it was not "
            f"measured on a GPU, so enter a production GPU time per request for GPU costs.")


def _savings_blocks(summary: MeasuredSummary, result: RoiResult, charts: dict[str, bytes]) -> list[Block]:
    times, alloc = result.gpu_time, result.allocation
    caveat = "" if times.entered else _priced_as_gpu_time(summary, result.inputs.load)
    blocks: list[Block] = [
        Heading("Savings and their basis"),
        Para(f"{_e(times.label(summary.time_label))} is {_e(number(times.before_s, 's/request'))} before pruning "
             f"({times.before_provenance.value}) and {_e(number(times.after_s, 's/request'))} after "
             f"({times.after_provenance.value}). On the allocation basis the busy GPU hours need "
             f"{alloc.gpus_before} reserved GPU(s) before pruning and {alloc.gpus_after} after; on the usage basis "
             f"{result.usage.gpu_hours_before:,.1f} billed GPU hours a day become {result.usage.gpu_hours_after:,.1f}."
             + (f" <b>{_e(caveat)}</b>" if caveat else "")),
    ]
    for basis in Basis:
        lines = cost_rows(result, basis)
        blocks.append(Table(header=("Cost line", "Before pruning", "After pruning", "Savings"),
                            rows=tuple((r["Line"], r["Before"], r["After"], r["Savings"]) for r in lines),
                            widths=(0.34, 0.22, 0.22, 0.22), bold_last_row=True,
                            title=f"{basis.value.capitalize()} basis, per month"))
    blocks.append(Para("Token counts and the failed-request share are taken as unchanged by pruning (the same "
                       "requests with the same output budget; a failed probe cannot be attributed to a "
                       "configuration), so the savings come from the GPU cost line.", small=True))
    milestone_rows = []
    for a, u in zip(result.milestones(Basis.ALLOCATION), result.milestones(Basis.USAGE)):
        milestone_rows.append((f"{a.days} days", usd(a.cumulative_savings_usd), usd(a.net_usd),
                               "n/a" if a.roi_pct is None else f"{a.roi_pct:.0f}%", usd(u.net_usd),
                               "n/a" if u.roi_pct is None else f"{u.roi_pct:.0f}%"))
    blocks.append(Table(header=("After", "Savings (alloc.)", "Net (alloc.)", "ROI (alloc.)", "Net (usage)", "ROI (usage)"),
                        rows=tuple(milestone_rows), widths=(0.14, 0.19, 0.18, 0.14, 0.2, 0.15),
                        title="Return at 30, 60 and 90 days (cumulative savings minus the implementation cost)"))
    blocks.append(ChartRow((
        Chart(charts["waterfall"], "Monthly cost before pruning, change per cost line, monthly cost after "
                                   "(allocation basis)."),
        Chart(charts["projection"], "Cumulative cost over the next 12 months without pruning, and with pruning "
                                    "including its implementation cost (allocation basis)."))))
    return blocks


def _pays_text(load: LoadPoint) -> str:
    """Where pruning stops paying, from the measured levels: 'Pruning pays at 1 client; not at 2, 4 and 8.'"""
    pays = [level.clients for level in load.profile.levels if level.pruned_vs_dense > 1]
    not_ = [level.clients for level in load.profile.levels if level.pruned_vs_dense <= 1]

    def clients(numbers: list[int]) -> str:
        head = ", ".join(map(str, numbers[:-1])) + (" and " if len(numbers) > 1 else "")
        return head + clients_text(numbers[-1]) if len(numbers) == 1 else head + f"{numbers[-1]} concurrent clients"

    if not not_:
        return f"Pruned serving streams more tokens per second than dense at every measured level ({clients(pays)})."
    if not pays:
        return f"Pruned serving streams fewer tokens per second than dense at every measured level ({clients(not_)})."
    return f"A pruned token is cheaper than a dense one at {clients(pays)}, and not at {clients(not_)}."


def _load_blocks(result: RoiResult, load: LoadPoint) -> list[Block]:
    """The 'Throughput under load' section: the basis, and cost per 1M output tokens at each measured level."""
    hourly = result.inputs.gpu_hourly_usd
    rows = load_rows(load, hourly)
    header = tuple(rows[0])
    return [
        Heading("Throughput under load"),
        Para(_e(result.inputs.describe_basis())),
        Table(header=header, rows=tuple(tuple(row[name] for name in header) for row in rows),
              widths=(0.15, 0.12, 0.12, 0.11, 0.16, 0.16, 0.18),
              title="Cost per 1M output tokens by concurrency, dense vs pruned"),
        Para(_e(_pays_text(load))),
        Para(_e(load_caption(load, hourly)), small=True),
    ]


def _trend_blocks(summary: MeasuredSummary, charts: dict[str, bytes], bucket_label: str, swing: float) -> list[Block]:
    rows = tuple(quality_rows(summary))
    return [
        Heading("Measured trends"),
        ChartRow((
            Chart(charts["trend"], f"Per {bucket_label} (UTC): mean pruning ratio of the pruned configuration and mean "
                                   "inference time per configuration."),
            Chart(charts["scatter"], "Pruning ratio against inference time, one dot per successful probe."))),
        Heading("Sensitivity"),
        Chart(charts["sensitivity"], f"Monthly savings (allocation basis) when one input moves by ±{swing:g}% and "
                                     "the others stay fixed; inputs without effect are left out. GPUs are reserved "
                                     "whole, so a small change in load can leave the GPU count, and the savings, "
                                     "unchanged.", width=0.8)
        if "sensitivity" in charts else Para(_e(no_sensitivity_text(PRIMARY_BASIS, swing))),
        Heading("Quality kept"),
        Table(header=("Figure", "Value", "How it was obtained"), rows=rows, widths=(0.28, 0.26, 0.46)),
        Para("The pruning ratio measures efficiency, never quality: quality is what the engine served, scored by a "
             "dense reference model on the same prompt.", small=True),
    ]


def _method_blocks(summary: MeasuredSummary, result: RoiResult) -> list[Block]:
    load = result.inputs.load
    caveat = "" if result.gpu_time.entered else _priced_as_gpu_time(summary, load)
    where = ("Token counts, failures and quality come from prunewatch probes in the window; time per request comes "
             "from the load run's aggregate tokens/s at the deployment's concurrency (requests batched together), "
             "not from the probes' one-at-a-time times." if load else
             "Measured figures come from prunewatch probes in the window; probes run one request at a time, so "
             "enter a production GPU time per request when serving batches many requests together.")
    under_load = ("; <i>measured-under-load</i> = derived from a load run's measured aggregate tokens/s at the "
                  "deployment's concurrency" if load else "")
    blocks: list[Block] = [
        Heading("Method and assumptions"),
        Bullets((
            *((f"Time per request is {_e(result.gpu_time.label(summary.time_label))}. {_e(caveat)}",)
              if caveat else ()),
            "GPU cost, usage basis = requests per day × GPU seconds per request / 3600 / utilisation × GPU price.",
            "GPU cost, allocation basis = whole GPUs reserved 24 h a day (enough for the busy hours at the "
            "utilisation, at least one) × 24 × GPU price.",
            "Token cost = requests × (input tokens × input price + output tokens × output price); input and "
            "output tokens are priced separately.",
            "Failure cost = requests × failed-request share × cost per failed request.",
            _e(basis_text(summary, result)),
            "Savings = cost before − cost after; payback = implementation cost / savings per day (no discounting).",
            where,
        )),
        Para("Provenance: <i>measured</i> = read from probe results (or the load run's file); <i>estimated</i> = "
             "derived from measurements through the stated model; <i>assumed-default</i> = the product's default "
             f"assumption; <i>user-entered</i> = changed by the user{under_load}.", small=True),
    ]
    rows = tuple((in_measured_words(r["Input"], summary, r["Provenance"]), r["Value"], r["Unit"], r["Provenance"], r["Note"])
                 for r in input_rows(result))
    blocks.append(Table(header=("Input", "Value", "Unit", "Provenance", "Note"), rows=rows,
                        widths=(0.19, 0.1, 0.15, 0.18, 0.38),
                        title="Every input and its provenance"))
    return blocks


def build_report(results: Sequence[ProbeResult], window: Window, assumptions: Assumptions, days: int,
                 target: str | None = None, model: str | None = None, sensitivity_pct: float = 20.0,
                 now: datetime | None = None, load: LoadPoint | None = None) -> ReportData:
    """Compute the ROI exactly as the app does, then lay the report out as blocks.

    With `load`, time per request is priced from the load run's throughput at its concurrency, and a
    'Throughput under load' section shows the cost per 1M output tokens at every measured level."""
    if days not in REPORT_DAYS:
        raise ValueError(f"report window must be one of {', '.join(map(str, REPORT_DAYS))} days, got {days}")
    summary, result = calculate(results, window, assumptions, target, model, load)
    chosen = select(results, window, target, model)
    width_s, points = trend(chosen)
    bucket_label = f"{width_s // 86_400}-day bucket" if width_s >= 86_400 else (
        f"{width_s // 3600}-hour bucket" if width_s >= 3600 else f"{width_s // 60}-minute bucket")
    rows = sensitivity(result, PRIMARY_BASIS, sensitivity_pct)
    pay = result.payback(PRIMARY_BASIS)
    charts = {
        "waterfall": report_charts.waterfall_png(waterfall(result, PRIMARY_BASIS)),
        "projection": report_charts.projection_png(projection(result, PRIMARY_BASIS), pay.months),
        "trend": report_charts.trend_png(points, width_s),
        "scatter": report_charts.scatter_png(scatter_points(chosen)),
    }
    if any(row.swing > 0 for row in rows):
        charts["sensitivity"] = report_charts.sensitivity_png(rows, sensitivity_pct,
                                                              result.costs(PRIMARY_BASIS).savings_per("month"))
    generated = now or datetime.now(UTC)
    where = summary.target or "all targets"
    models = ", ".join(summary.models) if summary.model is None else summary.model
    blocks: list[Block] = [Title(
        f"Pruning ROI report, last {days} days",
        f"Window {window.start:%Y-%m-%d} to {window.end:%Y-%m-%d} · {where} · model {models or 'n/a'} · "
        f"generated {generated:%Y-%m-%d %H:%M} UTC")]
    blocks += _summary_blocks(summary, result, assumptions)
    blocks += _savings_blocks(summary, result, charts)
    if load is not None:
        blocks += _load_blocks(result, load)
    blocks += _trend_blocks(summary, charts, bucket_label, sensitivity_pct)
    blocks += _method_blocks(summary, result)
    return ReportData(days=days, generated_at=generated, summary=summary, result=result, blocks=blocks)
