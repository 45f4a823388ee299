"""Versioned, hashed probes: calibration sets engines are fitted on, evaluation sets quality is read on."""

from prunewatch.probes.checks import Check
from prunewatch.probes.loader import (
    CALIBRATION_PATH,
    DEFAULT_PROBES_PATH,
    EVALUATION_PATH,
    Probe,
    ProbeFileError,
    ProbeSet,
    heldout_texts,
    load_calibration_set,
    load_probes,
    read_yaml,
)

__all__ = ["CALIBRATION_PATH", "DEFAULT_PROBES_PATH", "EVALUATION_PATH", "Check", "Probe", "ProbeFileError",
           "ProbeSet", "heldout_texts", "load_calibration_set", "load_probes", "read_yaml"]
