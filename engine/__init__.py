"""The pruning inference engine: loads a local causal LM, skips work per request, measures the skip.

The public surface is resolved on first use: importing `engine.stats` or `engine.errors` (what
exporters and the command line need) must not import torch.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

_EXPORTS = {
    "Calibration": "engine.calibration",
    "CalibrationMismatchError": "engine.errors",
    "EngineError": "engine.errors",
    "EngineSettings": "engine.settings",
    "GenerationResult": "engine.stats",
    "InvalidRequestError": "engine.errors",
    "LogLevel": "engine.settings",
    "ModelLoadError": "engine.errors",
    "PruningEngine": "engine.pruning_engine",
    "QualityReport": "engine.stats",
    "RATIO_UNIT": "engine.stats",
    "RequestStats": "engine.stats",
    "TokenDelta": "engine.pruning_engine",
    "UnsupportedArchitectureError": "engine.errors",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    value = getattr(import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value
