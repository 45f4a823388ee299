"""No evaluation text is calibrated on: every evaluation prompt and system prompt shares no run of eight
words with any calibration text or the held-out passages, and no prompt appears twice."""

from __future__ import annotations

import re
from collections.abc import Iterable

import pytest

from prunewatch.probes import CALIBRATION_PATH, DEFAULT_PROBES_PATH, EVALUATION_PATH, heldout_texts, load_probes

N = 8


def shingles(text: str, n: int = N) -> set[tuple[str, ...]]:
    words = re.findall(r"[a-z0-9']+", text.lower())
    return {tuple(words[i:i + n]) for i in range(len(words) - n + 1)}


def texts_of(path) -> list[str]:
    return [text for p in load_probes(path).probes for text in (p.system, p.prompt) if text]


def overlap(left: Iterable[str], right: Iterable[str]) -> set[tuple[str, ...]]:
    seen: set[tuple[str, ...]] = set()
    for text in right:
        seen |= shingles(text)
    return {s for text in left for s in shingles(text)} & seen


def test_the_detector_finds_a_shared_run_of_eight_words():
    assert overlap(["Explain why the sky is blue to a child in one sentence please"],
                   ["Could you explain why the sky is blue to a child in simple words"])
    assert not overlap(["the sky is blue"], ["the sky is blue"])  # under eight words: no run to share


@pytest.mark.parametrize("evaluation", [EVALUATION_PATH, DEFAULT_PROBES_PATH], ids=["evaluation", "canonical"])
def test_evaluation_prompts_share_no_text_with_calibration(evaluation):
    assert overlap(texts_of(evaluation), texts_of(CALIBRATION_PATH)) == set()
    assert overlap([p for p in texts_of(evaluation)], heldout_texts()) == set()


def test_no_prompt_appears_twice_within_a_set():
    for path in (EVALUATION_PATH, CALIBRATION_PATH):
        prompts = [p.prompt for p in load_probes(path).probes]
        assert len(prompts) == len(set(prompts)), path
