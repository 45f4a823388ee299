"""ROI: cost before and after pruning from measured probe data, load runs and labelled assumptions.

Imports nothing of the engine and no plotting or dataframe library: `prunewatch --help` loads it cheaply."""

from __future__ import annotations

from prunewatch.roi.analysis import projection, sensitivity, waterfall
from prunewatch.roi.assumptions import Assumptions
from prunewatch.roi.calculator import calculate
from prunewatch.roi.costs import Basis, RoiResult, compute
from prunewatch.roi.errors import NoMeasurementsError, NoTrafficError, RoiError, RoiStoreError
from prunewatch.roi.inputs import ResolvedInputs, TimeBasis, resolve_inputs
from prunewatch.roi.load_profile import LoadPoint, LoadProfile, LoadProfileError
from prunewatch.roi.measured import MeasuredSummary, Window, summarize
from prunewatch.roi.provenance import InputValue, Provenance

__all__ = [
    "Assumptions", "Basis", "InputValue", "LoadPoint", "LoadProfile", "LoadProfileError", "MeasuredSummary",
    "NoMeasurementsError", "NoTrafficError",
    "Provenance", "ResolvedInputs", "RoiError", "RoiResult", "RoiStoreError", "TimeBasis", "Window",
    "calculate", "compute", "projection", "resolve_inputs", "sensitivity", "summarize", "waterfall",
]
