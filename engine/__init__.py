"""The pruning inference engine: loads a local causal LM, skips work per request, measures the skip."""

from engine.calibration import Calibration
from engine.errors import (
    CalibrationMismatchError,
    EngineError,
    InvalidRequestError,
    ModelLoadError,
    UnsupportedArchitectureError,
)
from engine.pruning_engine import PruningEngine, TokenDelta
from engine.settings import EngineSettings, LogLevel
from engine.stats import RATIO_UNIT, GenerationResult, QualityReport, RequestStats

__all__ = [
    "Calibration",
    "CalibrationMismatchError",
    "EngineError",
    "EngineSettings",
    "GenerationResult",
    "InvalidRequestError",
    "LogLevel",
    "ModelLoadError",
    "PruningEngine",
    "QualityReport",
    "RATIO_UNIT",
    "RequestStats",
    "TokenDelta",
    "UnsupportedArchitectureError",
]
