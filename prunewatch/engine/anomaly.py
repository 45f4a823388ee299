"""Protective fallback: input that looks anomalous runs dense, and the stats say why.

Pruning decisions come from a calibration over ordinary domain text. Input far from that (control
characters, long runs of punctuation, byte soup, or a prompt that matches no calibrated domain)
gives no grounds for trusting the calibration, so such a request runs the dense model.
"""

from __future__ import annotations

import re
import unicodedata
from dataclasses import dataclass


@dataclass(frozen=True)
class AnomalyLimits:
    """Thresholds of the fallback checks (configuration)."""

    max_control_chars: int = 0  # any C0/C1 control character other than tab/newline/CR
    punctuation_run: int = 12  # this many punctuation characters in a row
    min_word_char_share: float = 0.55  # letters, digits and spaces / all characters, for prompts >= 24 chars
    max_tokens_per_char: float = 0.7  # byte-level BPE barely compresses byte soup
    min_domain_similarity: float = 0.2  # cosine to the nearest calibrated domain centroid


def _control_chars(text: str) -> int:
    return sum(1 for ch in text if unicodedata.category(ch) == "Cc" and ch not in "\t\n\r")


def anomaly_reason(text: str, token_count: int, nearest_domain_similarity: float | None,
                   limits: AnomalyLimits) -> str | None:
    """The first check the input fails, as a stable reason label; None for ordinary input."""
    if _control_chars(text) > limits.max_control_chars:
        return "control_characters"
    if re.search(rf"[^\w\s]{{{limits.punctuation_run},}}", text):
        return "punctuation_run"
    if len(text) >= 24:
        word_chars = sum(1 for ch in text if ch.isalnum() or ch.isspace())
        if word_chars / len(text) < limits.min_word_char_share or token_count / len(text) > limits.max_tokens_per_char:
            return "byte_soup"
    if nearest_domain_similarity is not None and nearest_domain_similarity < limits.min_domain_similarity:
        return "out_of_domain"
    return None
