"""Canonical domain probes: fixed, versioned, hashed prompts, so trends compare like with like."""

from prunewatch.probes.loader import (
                           DEFAULT_PROBES_PATH,
                           Probe,
                           ProbeFileError,
                           ProbeSet,
                           heldout_texts,
                           load_probes,
                           read_yaml,
)

__all__ = ["DEFAULT_PROBES_PATH", "Probe", "ProbeFileError", "ProbeSet", "heldout_texts", "load_probes", "read_yaml"]
