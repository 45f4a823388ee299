"""ROI: cost before and after pruning from measured probe data and labelled assumptions."""

from __future__ import annotations

from importlib import import_module
from typing import Any

# The public surface, resolved on first use so `prunewatch --help` (which imports prunewatch.commands.roi) stays fast.
_EXPORTS = {
    "Assumptions": "roi.assumptions",
    "Basis": "roi.costs",
    "InputValue": "roi.provenance",
    "MeasuredSummary": "roi.measured",
    "NoMeasurementsError": "roi.errors",
    "NoTrafficError": "roi.errors",
    "Provenance": "roi.provenance",
    "ResolvedInputs": "roi.inputs",
    "RoiError": "roi.errors",
    "RoiResult": "roi.costs",
    "RoiStoreError": "roi.errors",
    "TimeBasis": "roi.inputs",
    "Window": "roi.measured",
    "calculate": "roi.calculator",
    "compute": "roi.costs",
    "projection": "roi.analysis",
    "resolve_inputs": "roi.inputs",
    "sensitivity": "roi.analysis",
    "summarize": "roi.measured",
    "waterfall": "roi.analysis",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'roi' has no attribute {name!r}")
    value = getattr(import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value
