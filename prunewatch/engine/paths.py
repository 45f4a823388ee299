"""The one place that says where prunewatch keeps its per-user caches (models, calibrations, kernels)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """`$XDG_CACHE_HOME/prunewatch`, else `~/.cache/prunewatch`: every cache folder lives below it."""
    base = os.environ.get("XDG_CACHE_HOME")
    return (Path(base).expanduser() if base else Path.home() / ".cache") / "prunewatch"


def calibration_cache() -> Path:
    """Default folder of cached calibrations (block influence and activation thresholds)."""
    return cache_root() / "calibration"
