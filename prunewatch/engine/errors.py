"""Typed engine errors: each message says what was wrong and what to do about it."""


class EngineError(Exception):
    """Base class for errors a user can act on (bad model folder, bad request, bad calibration)."""


class ModelLoadError(EngineError):
    """The model folder is missing, has no weights, or cannot be loaded by transformers."""


class UnsupportedArchitectureError(EngineError):
    """The model's decoder blocks cannot be located or wrapped safely (raised when the model is loaded)."""


class CalibrationMismatchError(EngineError):
    """A calibration artifact was made for a different model (its weights hash differs)."""


class InvalidRequestError(EngineError):
    """A request parameter is out of range (sensitivity, blacklist layer, max_tokens...)."""


class KVBudgetError(InvalidRequestError):
    """A request whose KV cache (prompt plus max new tokens) alone needs more than the batcher's whole budget."""
