"""The pruning inference engine: loads a local causal LM, skips work per request, measures the skip.

The public surface is resolved on first use: importing `prunewatch.engine.stats` or `prunewatch.engine.errors` (what
exporters and the command line need) must not import torch.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

_EXPORTS = {
    "Calibration": "prunewatch.engine.calibration",
    "CalibrationMismatchError": "prunewatch.engine.errors",
    "EngineError": "prunewatch.engine.errors",
    "EngineSettings": "prunewatch.engine.settings",
    "GenerationResult": "prunewatch.engine.stats",
    "InvalidRequestError": "prunewatch.engine.errors",
    "LogLevel": "prunewatch.engine.settings",
    "ModelLoadError": "prunewatch.engine.errors",
    "PruningEngine": "prunewatch.engine.pruning_engine",
    "QualityReport": "prunewatch.engine.stats",
    "RATIO_UNIT": "prunewatch.engine.stats",
    "RequestStats": "prunewatch.engine.stats",
    "TokenDelta": "prunewatch.engine.pruning_engine",
    "UnsupportedArchitectureError": "prunewatch.engine.errors",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    value = getattr(import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value
