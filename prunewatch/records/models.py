"""Facts about models that readers of records need without loading the engine."""

from __future__ import annotations

BUNDLED_PROBE_MODEL = "probe-llama"
"""Name the engine reports for the bundled probe model (the folder prunewatch/engine/models/probe-llama, the engine's
PROBE_MODEL_DIR): its numbers prove the plumbing, not production savings. tests/test_import_graph.py checks
that both name the same folder."""
