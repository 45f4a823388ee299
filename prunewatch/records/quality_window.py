"""The served quality of one (target, model, domain) over its recent rounds, with 95% intervals.

Quality is read on evidence, not on one probe: the reference-scored agreement of every answer the
target served at its current sensitivity in the last `window_rounds` rounds, pooled over prompts, with
an interval bootstrapped over prompts (records/intervals.py); the task pass rate likewise. A prompt
answered again counts once, by its newest answer (a greedy engine repeats itself, so repeats are not
new evidence); answers at another sensitivity, dense baselines and requests that fell back to dense
are not evidence of the setting. The collector exports these (records/metrics.py), the embedded alert
evaluator replays them from stored results the same way (alerts/_series.py), and the governor decides
on them (collector/governor.py).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

from prunewatch.records.intervals import Interval, bootstrap_rate, bootstrap_share
from prunewatch.records.results import ProbeResult

WINDOW_ROUNDS = 10
"""Rounds of answers an estimate pools by default."""


def is_evidence(result: ProbeResult) -> bool:
    """Whether a result says something of the target's pruned quality at its setting."""
    return result.ok and not result.baseline and not result.fallback_reason


def scored_answer(result: ProbeResult) -> tuple[int, int] | None:
    """(answer tokens equal to the reference's argmax, tokens scored) of a served answer; None when unscored."""
    if (not is_evidence(result) or result.reference_agreement is None or not result.reference_tokens
            or not math.isfinite(result.reference_agreement)):
        return None
    tokens = int(result.reference_tokens)
    return round(result.reference_agreement * tokens), tokens


@dataclass
class _Answer:
    scored: tuple[int, int] | None
    passed: bool | None
    round_index: int


@dataclass
class AnswerWindow:
    """The evidence of one (target, model, domain): per prompt its newest answer in the last rounds."""

    window_rounds: int = WINDOW_ROUNDS
    sensitivity: float | None = None
    answers: dict[tuple[str, int], _Answer] = field(default_factory=dict)  # (probe id, version) -> newest answer
    rounds: list[str] = field(default_factory=list)  # round ids seen, oldest first (the last window_rounds kept)
    _dropped: int = 0  # rounds that left the window, so round indices count from the first round seen

    def add(self, result: ProbeResult) -> bool:
        """Take one result; True when it changed the evidence."""
        if not is_evidence(result):
            return False
        if result.sensitivity != self.sensitivity:  # another setting: what was known is of the old one
            self.answers.clear()
            self.rounds.clear()
            self.sensitivity = result.sensitivity
        if not self.rounds or self.rounds[-1] != result.round_id:
            if result.round_id in self.rounds:
                self.rounds.remove(result.round_id)
            self.rounds.append(result.round_id)
        index = len(self.rounds) - 1
        self.answers[(result.probe_id, result.probe_version)] = _Answer(scored_answer(result), result.task_passed,
                                                                        index + self._dropped)
        if len(self.rounds) > self.window_rounds:
            drop = len(self.rounds) - self.window_rounds
            del self.rounds[:drop]
            self._dropped += drop
        oldest = self._dropped
        self.answers = {k: a for k, a in self.answers.items() if a.round_index >= oldest}
        return True

    def extend(self, results: Iterable[ProbeResult]) -> None:
        for result in results:
            self.add(result)

    def agreement(self) -> Interval | None:
        """Pooled reference-scored agreement of the prompts in the window, with its interval; None: none scored."""
        scored = [a.scored for a in self.answers.values() if a.scored is not None]
        return bootstrap_share([m for m, _ in scored], [n for _, n in scored])

    def pass_rate(self) -> Interval | None:
        """Share of checked prompts whose newest answer passed its check, with its interval; None: none checked."""
        return bootstrap_rate([a.passed for a in self.answers.values() if a.passed is not None])


class QualityWindows:
    """An AnswerWindow per (target, model, domain), fed result by result."""

    def __init__(self, window_rounds: int = WINDOW_ROUNDS) -> None:
        self.window_rounds = window_rounds
        self.windows: dict[tuple[str, str, str], AnswerWindow] = {}

    def add(self, result: ProbeResult) -> AnswerWindow | None:
        """Take one result; the window it changed, or None."""
        key = (result.target, result.model, result.domain)
        window = self.windows.get(key)
        if window is None:
            if not is_evidence(result):
                return None
            window = self.windows[key] = AnswerWindow(self.window_rounds)
        return window if window.add(result) else None
