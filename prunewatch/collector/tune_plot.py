"""The tuning plot: ratio, latency and quality against sensitivity, with the knees and the recommendation."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import matplotlib

matplotlib.use("Agg")  # files only; never a window
import matplotlib.pyplot as plt


class _Point(Protocol):
    """One sweep point as the plot reads it (tune.SweepPoint)."""

    @property
    def sensitivity(self) -> float: ...
    @property
    def pruning_ratio(self) -> float | None: ...
    @property
    def latency_ms(self) -> float | None: ...
    @property
    def quality(self) -> float | None: ...


class _Sweep(Protocol):
    """What the plot reads of a tune.TuneReport; a protocol, since tune imports this module (no cycle)."""

    @property
    def target(self) -> str: ...
    @property
    def model(self) -> str: ...
    @property
    def measured_at(self) -> str: ...
    @property
    def probes(self) -> int: ...
    @property
    def latency_source(self) -> str: ...
    @property
    def quality_source(self) -> str: ...
    @property
    def points(self) -> Sequence[_Point]: ...
    @property
    def quality_knee(self) -> float | None: ...
    @property
    def latency_knee(self) -> float | None: ...
    @property
    def knee(self) -> float: ...
    @property
    def margin(self) -> float: ...
    @property
    def recommended_sensitivity(self) -> float: ...


def plot_sweep(report: _Sweep, path: Path) -> Path:
    """Two panels sharing the sensitivity axis: efficiency (ratio, latency) above, quality below."""
    xs = [p.sensitivity for p in report.points]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6.5), sharex=True, height_ratios=[3, 2])
    ratio = [p.pruning_ratio for p in report.points]
    top.plot(xs, ratio, "o-", color="tab:blue", label="pruning ratio (measured, linear FLOPs)")
    top.set_ylabel("pruning ratio", color="tab:blue")
    top.set_ylim(0, max(0.05, max(r for r in ratio if r is not None) * 1.15))
    latency_axis = top.twinx()
    latency_axis.plot(xs, [p.latency_ms for p in report.points], "s--", color="tab:orange",
                      label=f"latency: {report.latency_source}")
    latency_axis.set_ylabel("ms per generated token (median)", color="tab:orange")
    bottom.plot(xs, [p.quality for p in report.points], "o-", color="tab:green", label="quality")
    bottom.set_ylabel("quality (mean)")
    bottom.set_xlabel("sensitivity")
    bottom.set_ylim(min(0.9, min(p.quality for p in report.points if p.quality is not None) - 0.02), 1.01)
    recommended = (f"recommended {report.recommended_sensitivity:.2f} "
                   f"(knee {report.knee:.2f} - margin {report.margin:.2f})")
    marks = [(report.quality_knee, "quality knee", "tab:green", ":"),
             (report.latency_knee, "latency knee", "tab:orange", ":"),
             (report.recommended_sensitivity, recommended, "tab:red", "-")]
    for axis in (top, bottom):
        for x, label, colour, style in marks:
            if x is not None:
                axis.axvline(x, color=colour, linestyle=style, linewidth=1.5, label=label if axis is bottom else None)
        axis.grid(alpha=0.3)
    handles = top.get_legend_handles_labels()[0] + latency_axis.get_legend_handles_labels()[0]
    top.legend(handles, [h.get_label() for h in handles], loc="upper left", fontsize=8)
    bottom.legend(loc="lower left", fontsize=8)
    fig.text(0.01, 0.005, f"quality: {report.quality_source}", ha="left", va="bottom", fontsize=7, color="0.35")
    fig.suptitle(f"prunewatch tune · target {report.target} · model {report.model} · "
                 f"{report.probes} probes per point · {report.measured_at}", fontsize=9)
    fig.tight_layout(rect=(0, 0.025, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
