"""Placeholder prices shared by every part that shows a cost (the ROI app and report, the dashboards).

None of these is a measurement or a quoted price. They exist so that a fresh install shows cost figures
at all; each reader labels them as placeholders ("assumed default" in the ROI app and report, "configured"
in the dashboards' cost panels) until the user enters their own. They live below both readers so that
neither imports the other for them.
"""

from __future__ import annotations

PLACEHOLDER_GPU_USD_PER_HOUR = 0.91
"""One GPU hour: of the order of a small cloud GPU's hourly rental."""
PLACEHOLDER_INPUT_USD_PER_MTOK = 0.50
"""1M input (prompt) tokens: an API list price or an internal charge-back."""
PLACEHOLDER_OUTPUT_USD_PER_MTOK = 1.50
"""1M output (completion) tokens, priced separately from input tokens."""
