"""Matplotlib charts of the CFO report, as PNG bytes shared by the PDF and the HTML variant.

They plot the same pure series as the app's Altair charts (prunewatch.roi.analysis, prunewatch.roi.measured).
Figures are built with `matplotlib.figure.Figure` directly, so no global pyplot state or GUI
backend is involved.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from datetime import timedelta

from matplotlib.axes import Axes
from matplotlib.dates import AutoDateLocator, ConciseDateFormatter
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter

from prunewatch.roi.analysis import ProjectionPoint, SensitivityRow, WaterfallStep
from prunewatch.roi.measured import ScatterPoint, TrendPoint

BEFORE, AFTER, SAVING, INCREASE, RATIO = "#9aa5b1", "#1f77b4", "#2ca02c", "#d62728", "#d62728"
DPI = 160
_DOLLARS = FuncFormatter(lambda value, _pos: f"-${abs(value):,.0f}" if value < 0 else f"${value:,.0f}")


def _png(figure: Figure) -> bytes:
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=DPI, bbox_inches="tight")
    return buffer.getvalue()


def _figure(width_in: float = 6.4, height_in: float = 3.0) -> tuple[Figure, Axes]:
    figure = Figure(figsize=(width_in, height_in))
    axes = figure.add_subplot()
    axes.spines[["top", "right"]].set_visible(False)
    axes.grid(axis="y", color="#e5e5e5", linewidth=0.8)
    axes.set_axisbelow(True)
    return figure, axes


PAIR = (4.4, 3.1)  # inches of a chart printed at half the text width, so its fonts stay legible


def projection_png(points: Sequence[ProjectionPoint], payback_months: float | None) -> bytes:
    """Cumulative cost over the coming months, before vs after pruning (after includes the one-off cost)."""
    figure, axes = _figure(*PAIR)
    months = [p.month for p in points]
    axes.plot(months, [p.before_usd for p in points], color=BEFORE, linewidth=2.2, label="Without pruning")
    axes.plot(months, [p.after_usd for p in points], color=AFTER, linewidth=2.2,
              label="With pruning, including implementation cost")
    if payback_months is not None and payback_months <= months[-1]:
        axes.axvline(payback_months, color="#555555", linestyle=":", linewidth=1)
        axes.annotate(f"payback {payback_months:.1f} months", xy=(payback_months, axes.get_ylim()[1] * 0.92),
                      xytext=(4, 0), textcoords="offset points", fontsize=8, color="#333333")
    axes.yaxis.set_major_formatter(_DOLLARS)
    axes.set_xlabel("Months from today")
    axes.set_ylabel("Cumulative cost")
    axes.set_xlim(0, months[-1])
    axes.legend(frameon=False, fontsize=7.5, loc="lower right")
    return _png(figure)


def waterfall_png(steps: Sequence[WaterfallStep]) -> bytes:
    """Monthly cost before, the change of each cost line, monthly cost after."""
    figure, axes = _figure(*PAIR)
    labels = []
    for index, step in enumerate(steps):
        labels.append(step.label)
        if step.is_total:
            axes.bar(index, step.amount_usd, color=BEFORE if index == 0 else AFTER, width=0.6)
            text, y = f"${step.amount_usd:,.0f}", step.amount_usd
        else:
            color = SAVING if step.amount_usd < 0 else (INCREASE if step.amount_usd > 0 else "#cccccc")
            axes.bar(index, step.amount_usd, bottom=step.start_usd, color=color, width=0.6)
            sign = "-" if step.amount_usd < 0 else "+"
            text, y = f"{sign}${abs(step.amount_usd):,.0f}", max(step.start_usd, step.start_usd + step.amount_usd)
        axes.annotate(text, xy=(index, y), xytext=(0, 3), textcoords="offset points", ha="center", fontsize=8)
    axes.set_xticks(range(len(labels)), labels)
    axes.yaxis.set_major_formatter(_DOLLARS)
    axes.set_ylabel("$ per month")
    return _png(figure)


def trend_png(points: Sequence[TrendPoint], bucket_s: int) -> bytes:
    """Measured pruning ratio and inference time per bucket over the window (times in UTC)."""
    figure = Figure(figsize=PAIR)
    top, bottom = figure.subplots(2, 1, sharex=True, gridspec_kw={"height_ratios": [1, 1.3]})
    for axes in (top, bottom):
        axes.spines[["top", "right"]].set_visible(False)
        axes.grid(axis="y", color="#e5e5e5", linewidth=0.8)
    ratio = [(p.start, p.mean_pruning_ratio) for p in points if p.mean_pruning_ratio is not None]
    if ratio:
        top.plot([t for t, _ in ratio], [v for _, v in ratio], marker="o", color=RATIO, linewidth=1.6)
    top.set_ylim(bottom=0)
    top.set_ylabel("Pruning ratio")
    for name, color, attribute in (("pruned", AFTER, "pruned_inference_ms"), ("dense", BEFORE, "dense_inference_ms")):
        series = [(p.start, getattr(p, attribute)) for p in points if getattr(p, attribute) is not None]
        if series:
            bottom.plot([t for t, _ in series], [v for _, v in series], marker="o", color=color, linewidth=1.6,
                        label=f"{name} configuration")
    bottom.set_ylim(bottom=0)
    bottom.set_ylabel("Inference ms")
    bottom.legend(frameon=False, fontsize=8)
    if points:  # pad by one bucket so a single bucket is not stretched over years by autoscaling
        pad = timedelta(seconds=bucket_s)
        bottom.set_xlim(points[0].start - pad, points[-1].start + pad)
    locator = AutoDateLocator(minticks=3, maxticks=7)
    bottom.xaxis.set_major_locator(locator)
    bottom.xaxis.set_major_formatter(ConciseDateFormatter(locator))
    return _png(figure)


def scatter_png(points: Sequence[ScatterPoint]) -> bytes:
    """Measured pruning ratio against inference time, one dot per successful probe, by domain."""
    figure, axes = _figure(*PAIR)
    markers = {"pruned": "o", "dense": "s"}
    for domain in sorted({p.domain for p in points}):
        for config, marker in markers.items():
            chosen = [p for p in points if p.domain == domain and p.configuration == config]
            if chosen:
                axes.scatter([p.pruning_ratio for p in chosen], [p.inference_ms for p in chosen], marker=marker,
                             s=28, alpha=0.85, label=f"{domain} ({config})")
    axes.set_xlabel("Pruning ratio (measured)")
    axes.set_ylabel("Inference ms (measured)")
    axes.set_xlim(left=min([0.0] + [p.pruning_ratio for p in points]) - 0.01)
    axes.set_ylim(bottom=0)
    axes.legend(frameon=False, fontsize=7, ncol=2)
    return _png(figure)


def sensitivity_png(rows: Sequence[SensitivityRow], pct: float, base_usd: float) -> bytes:
    """Tornado chart: monthly savings when one input moves by ±pct%."""
    moved = [row for row in rows if row.swing > 0][::-1]
    figure, axes = _figure(6.4, 0.9 + 0.38 * max(1, len(moved)))
    axes.grid(axis="x", color="#e5e5e5", linewidth=0.8)
    axes.grid(axis="y", visible=False)
    for index, row in enumerate(moved):
        low, high = row.savings_low or 0.0, row.savings_high or 0.0
        axes.barh(index, high - low, left=low, color="#c7d3e0", height=0.42)
        axes.plot([low], [index], "o", color="#ff7f0e")
        axes.plot([high], [index], "o", color=AFTER)
    axes.axvline(base_usd, color="#333333", linestyle="--", linewidth=1)
    axes.set_yticks(range(len(moved)), [row.label for row in moved])
    axes.set_ylim(-0.7, max(1, len(moved)) - 0.3)
    axes.xaxis.set_major_formatter(_DOLLARS)
    axes.set_xlabel(f"Savings per month (orange: input -{pct:g}%, blue: input +{pct:g}%; dashed: as computed)",
                    fontsize=8.5)
    return _png(figure)
