"""Altair charts for the app, drawn from the same pure series the report plots with matplotlib."""

from __future__ import annotations

from collections.abc import Sequence

import altair as alt
import pandas as pd

from prunewatch.roi.analysis import ProjectionPoint, SensitivityRow, WaterfallStep
from prunewatch.roi.load_profile import LoadCostRow
from prunewatch.roi.measured import ScatterPoint, TrendPoint

BEFORE, AFTER, SAVING, INCREASE = "#9aa5b1", "#1f77b4", "#2ca02c", "#d62728"


def projection_chart(points: Sequence[ProjectionPoint]) -> alt.Chart:
    """Cumulative cost without pruning vs with pruning (including its implementation cost)."""
    rows = [{"Month": p.month, "Scenario": "Before pruning", "Cumulative cost ($)": p.before_usd} for p in points]
    rows += [{"Month": p.month, "Scenario": "After pruning + implementation cost", "Cumulative cost ($)": p.after_usd}
             for p in points]
    return alt.Chart(pd.DataFrame(rows)).mark_line(point=True).encode(
        x=alt.X("Month:Q", title="Months from today"),
        y=alt.Y("Cumulative cost ($):Q", axis=alt.Axis(format="$,.0f")),
        color=alt.Color("Scenario:N", scale=alt.Scale(range=[AFTER, BEFORE]), legend=alt.Legend(orient="bottom", labelLimit=300)),
        tooltip=["Scenario", "Month", alt.Tooltip("Cumulative cost ($):Q", format="$,.0f")],
    ).properties(height=300)


def waterfall_chart(steps: Sequence[WaterfallStep]) -> alt.Chart:
    """Monthly cost before, the change of each line, monthly cost after."""
    rows = []
    for order, step in enumerate(steps):
        if step.is_total:
            start, end, kind = 0.0, step.amount_usd, "Total"
        else:
            start, end = step.start_usd, step.start_usd + step.amount_usd
            kind = "Saving" if step.amount_usd < 0 else ("Increase" if step.amount_usd > 0 else "No change")
        rows.append({"order": order, "Step": step.label, "start": start, "end": end, "kind": kind,
                     "Amount ($/month)": step.amount_usd})
    return alt.Chart(pd.DataFrame(rows)).mark_bar(size=40).encode(
        x=alt.X("Step:N", sort=alt.SortField("order"), title=None),
        y=alt.Y("start:Q", title="$ per month", axis=alt.Axis(format="$,.0f")),
        y2="end:Q",
        color=alt.Color("kind:N", title=None, scale=alt.Scale(domain=["Total", "Saving", "Increase", "No change"],
                                                              range=[BEFORE, SAVING, INCREASE, "#cccccc"])),
        tooltip=["Step", alt.Tooltip("Amount ($/month):Q", format="$,.2f")],
    ).properties(height=300)


def scatter_chart(points: Sequence[ScatterPoint]) -> alt.Chart:
    """Measured pruning ratio against inference time, one dot per successful probe."""
    frame = pd.DataFrame([{"Pruning ratio": p.pruning_ratio, "Inference time (ms)": p.inference_ms,
                           "Domain": p.domain, "Configuration": p.configuration, "Probe": p.probe_id,
                           "At": p.created_at.isoformat()} for p in points])
    return alt.Chart(frame).mark_circle(size=70, opacity=0.8).encode(
        x=alt.X("Pruning ratio:Q", scale=alt.Scale(zero=True)),
        y=alt.Y("Inference time (ms):Q"),
        color="Domain:N", shape="Configuration:N",
        tooltip=["Probe", "Domain", "Configuration", "Pruning ratio", "Inference time (ms)", "At"],
    ).properties(height=300)


def trend_chart(points: Sequence[TrendPoint]) -> alt.VConcatChart:
    """Measured pruning ratio (top) and inference time per configuration (bottom) per time bucket."""
    ratio = pd.DataFrame([{"Bucket": p.start.isoformat(), "Pruning ratio": p.mean_pruning_ratio}
                          for p in points if p.mean_pruning_ratio is not None], columns=["Bucket", "Pruning ratio"])
    latency = pd.DataFrame(
        [{"Bucket": p.start.isoformat(), "Configuration": name, "Inference time (ms)": value}
         for p in points for name, value in (("pruned", p.pruned_inference_ms), ("dense", p.dense_inference_ms))
         if value is not None], columns=["Bucket", "Configuration", "Inference time (ms)"])
    x = alt.X("Bucket:T", title=None)
    top = alt.Chart(ratio).mark_line(point=True, color="#d62728").encode(
        x=x, y=alt.Y("Pruning ratio:Q", scale=alt.Scale(zero=True)), tooltip=["Bucket:T", "Pruning ratio:Q"]
    ).properties(height=110, width="container")
    bottom = alt.Chart(latency).mark_line(point=True).encode(
        x=x, y="Inference time (ms):Q",
        color=alt.Color("Configuration:N", scale=alt.Scale(domain=["pruned", "dense"], range=[AFTER, BEFORE]),
                        legend=alt.Legend(orient="bottom")),
        tooltip=["Bucket:T", "Configuration", "Inference time (ms):Q"]).properties(height=150, width="container")
    return alt.vconcat(top, bottom)


def sensitivity_height(rows: Sequence[SensitivityRow]) -> int:
    """Pixels for the tornado chart: a band per input that moves savings."""
    return 90 + 36 * sum(1 for row in rows if row.swing > 0)


def sensitivity_chart(rows: Sequence[SensitivityRow], pct: float, base_usd: float) -> alt.LayerChart:
    """Tornado: monthly savings with each input moved down and up by pct percent, the others fixed."""
    moved = [row for row in rows if row.swing > 0]
    order = [row.label for row in moved]
    down, up = f"input -{pct:g}%", f"input +{pct:g}%"
    known = [(r.label, r.savings_low, r.savings_high) for r in moved  # swing > 0: both savings are known
             if r.savings_low is not None and r.savings_high is not None]
    spans = pd.DataFrame([{"Input": label, "low": min(low, high), "high": max(low, high)} for label, low, high in known],
                         columns=["Input", "low", "high"])
    ends = pd.DataFrame([{"Input": r.label, "Move": move, "Savings ($/month)": value}
                         for r in moved for move, value in ((down, r.savings_low), (up, r.savings_high))],
                        columns=["Input", "Move", "Savings ($/month)"])
    height = max(36, sensitivity_height(rows) - 90)
    y = alt.Y("Input:N", sort=order, title=None, axis=alt.Axis(labelLimit=260))
    span = alt.Chart(spans).mark_bar(size=14, color="#c7d3e0").encode(
        y=y, x=alt.X("low:Q", title="Savings ($ per month)", axis=alt.Axis(format="$,.0f")), x2="high:Q"
    ).properties(height=height)
    dots = alt.Chart(ends).mark_point(filled=True, size=110, opacity=1).encode(
        y=y, x="Savings ($/month):Q",
        color=alt.Color("Move:N", title=None, scale=alt.Scale(domain=[down, up], range=["#ff7f0e", AFTER]),
                        legend=alt.Legend(orient="bottom")),
        tooltip=["Input:N", "Move:N", alt.Tooltip("Savings ($/month):Q", format="$,.2f")]).properties(height=height)
    base = alt.Chart(pd.DataFrame([{"base": base_usd}])).mark_rule(strokeDash=[4, 4]).encode(x="base:Q")
    # LayerChart directly: alt.layer() may return a FacetChart, which it does only for facet encodings (none here).
    return alt.LayerChart(layer=[span, dots, base]).properties(height=height)


def load_cost_chart(rows: Sequence[LoadCostRow], concurrency: int) -> alt.LayerChart:
    """Cost per 1M output tokens, dense vs pruned, by concurrent clients; a rule marks the deployment's level."""
    frame = pd.DataFrame([{"Concurrent clients": row.level.clients, "Configuration": name, "$ per 1M output tokens": value}
                          for row in rows for name, value in (("dense", row.dense_usd_per_mtok),
                                                              ("pruned", row.pruned_usd_per_mtok))])
    x = alt.X("Concurrent clients:Q", scale=alt.Scale(type="log", base=2),
              axis=alt.Axis(values=[row.level.clients for row in rows], format="d"))
    lines = alt.Chart(frame).mark_line(point=True).encode(
        x=x, y=alt.Y("$ per 1M output tokens:Q", axis=alt.Axis(format="$,.2f")),
        color=alt.Color("Configuration:N", scale=alt.Scale(domain=["pruned", "dense"], range=[AFTER, BEFORE]),
                        legend=alt.Legend(orient="bottom")),
        tooltip=["Configuration", "Concurrent clients", alt.Tooltip("$ per 1M output tokens:Q", format="$,.2f")])
    rule = alt.Chart(pd.DataFrame([{"Concurrent clients": concurrency}])).mark_rule(strokeDash=[4, 4]).encode(x=x)
    return alt.LayerChart(layer=[lines, rule]).properties(height=260)
