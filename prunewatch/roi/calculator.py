"""One entry point from probe results and assumptions to an ROI result (used by app, CLI and report)."""

from __future__ import annotations

from collections.abc import Iterable

from prunewatch.records.results import ProbeResult
from prunewatch.roi.assumptions import Assumptions
from prunewatch.roi.costs import RoiResult, compute
from prunewatch.roi.inputs import resolve_inputs
from prunewatch.roi.load_profile import LoadPoint
from prunewatch.roi.measured import MeasuredSummary, Window, summarize


def calculate(results: Iterable[ProbeResult], window: Window, assumptions: Assumptions,
              target: str | None = None, model: str | None = None,
              load: LoadPoint | None = None) -> tuple[MeasuredSummary, RoiResult]:
    """Summarize the window's measurements, then cost them; raises RoiError subclasses with user messages.

    With `load`, the time per request is priced from the load run's throughput at its concurrency."""
    summary = summarize(results, window, target, model)
    return summary, compute(resolve_inputs(summary, assumptions, load))
