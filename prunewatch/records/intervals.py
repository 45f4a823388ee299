"""Confidence intervals for quality figures, bootstrapped over prompts.

Tokens within one answer are correlated (an answer that leaves the reference early tends to stay off
it), so a share pooled over tokens must not be given a binomial interval over tokens: the unit that
was sampled is the prompt. `bootstrap_share` resamples prompts with replacement and recomputes the
pooled share (matches over tokens of the resampled prompts) each time; the interval is the 2.5th and
97.5th percentile of those shares. A pass rate is the same with one "token" per prompt.

The resampling uses a fixed seed, so the same evidence always gives the same interval (a stored
decision can be recomputed from its results). Plain numpy: readers of records (alerts, ROI, dashboards)
use it without torch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass

import numpy as np

CONFIDENCE = 0.95
"""The level of every interval prunewatch reports."""

RESAMPLES = 2000
"""Bootstrap resamples: the percentile bounds move by well under 0.005 between seeds at this count."""

_SEED = 20261202


@dataclass(frozen=True)
class Interval:
    """A pooled share with its 95% bootstrap interval and the evidence behind it."""

    estimate: float  # pooled share: sum of matches over sum of tokens (or passes over prompts)
    low: float  # 2.5th percentile of the bootstrap distribution
    high: float  # 97.5th percentile
    prompts: int  # prompts (the resampled unit)
    tokens: int  # tokens pooled (equals prompts for a pass rate)

    def separated_from(self, other: Interval) -> bool:
        """The two intervals do not overlap: only then is a difference between them claimed."""
        return self.low > other.high or other.low > self.high

    def to_dict(self) -> dict[str, float | int]:
        return asdict(self)

    @classmethod
    def from_dict(cls, values: Mapping[str, float | int]) -> Interval:
        """The inverse of `to_dict`, for intervals read back from stored JSON."""
        return cls(estimate=float(values["estimate"]), low=float(values["low"]), high=float(values["high"]),
                   prompts=int(values["prompts"]), tokens=int(values["tokens"]))

    def __str__(self) -> str:
        return (f"{self.estimate:.3f} [{self.low:.3f}, {self.high:.3f}] "
                f"({self.prompts} prompts, {self.tokens} tokens)")


def bootstrap_share(matches: Sequence[float], totals: Sequence[float], *, resamples: int = RESAMPLES,
                    confidence: float = CONFIDENCE, seed: int = _SEED) -> Interval | None:
    """The pooled share sum(matches) / sum(totals) over prompts, with its bootstrap interval.

    `matches[i]` and `totals[i]` belong to prompt i (e.g. answer tokens equal to the reference's argmax,
    and answer tokens scored). Prompts with a total of 0 carry no evidence and are left out. None when
    no prompt is left."""
    if len(matches) != len(totals):
        raise ValueError(f"{len(matches)} match counts for {len(totals)} totals")
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    m = np.asarray(matches, dtype=np.float64)
    t = np.asarray(totals, dtype=np.float64)
    if np.any(t < 0) or np.any(m < 0) or np.any(m > t):
        raise ValueError("each prompt needs 0 <= matches <= total")
    keep = t > 0
    m, t = m[keep], t[keep]
    n = int(m.size)
    if n == 0:
        return None
    estimate = float(m.sum() / t.sum())
    if n == 1:  # one prompt says nothing of how prompts vary: the interval is as wide as it can be
        return Interval(estimate, 0.0, 1.0, 1, int(t.sum()))
    low, high = _resampled_ratio_bounds(m, t, resamples=resamples, confidence=confidence, seed=seed)
    return Interval(estimate, low, high, n, int(t.sum()))


def _resampled_ratio_bounds(numerators: np.ndarray, denominators: np.ndarray, *, resamples: int,
                            confidence: float, seed: int) -> tuple[float, float]:
    """Percentile bounds of sum(numerators) / sum(denominators) over units drawn with replacement."""
    n = int(numerators.size)
    rng = np.random.default_rng(seed)
    picks = rng.integers(0, n, size=(resamples, n))  # (R, n): units drawn with replacement
    ratios = numerators[picks].sum(axis=1) / denominators[picks].sum(axis=1)  # (R,)
    tail = (1.0 - confidence) / 2.0
    low, high = np.quantile(ratios, [tail, 1.0 - tail])
    return float(low), float(high)


def bootstrap_rate(outcomes: Sequence[bool], *, resamples: int = RESAMPLES, confidence: float = CONFIDENCE,
                   seed: int = _SEED) -> Interval | None:
    """A pass rate over prompts (one outcome each) with its bootstrap interval; None without outcomes."""
    values = [1.0 if passed else 0.0 for passed in outcomes]
    return bootstrap_share(values, [1.0] * len(values), resamples=resamples, confidence=confidence, seed=seed)


def bootstrap_ratio(numerators: Sequence[float], denominators: Sequence[float], *, resamples: int = RESAMPLES,
                    confidence: float = CONFIDENCE, seed: int = _SEED) -> Interval | None:
    """The ratio sum(numerators) / sum(denominators) over paired units, with its bootstrap interval.

    For figures that are not shares, such as a pruned time over the dense time of the same prompt: unit i
    contributes (numerators[i], denominators[i]), units are resampled with replacement, and the interval is
    read as for `bootstrap_share`. `prompts` and `tokens` both count the units. With one unit the interval is
    [0, inf]: one pair says nothing of how pairs vary. None without units."""
    if len(numerators) != len(denominators):
        raise ValueError(f"{len(numerators)} numerators for {len(denominators)} denominators")
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    a = np.asarray(numerators, dtype=np.float64)
    b = np.asarray(denominators, dtype=np.float64)
    if np.any(a < 0) or np.any(b <= 0) or not np.all(np.isfinite(a)) or not np.all(np.isfinite(b)):
        raise ValueError("each unit needs a finite numerator >= 0 and a finite denominator > 0")
    n = int(a.size)
    if n == 0:
        return None
    estimate = float(a.sum() / b.sum())
    if n == 1:
        return Interval(estimate, 0.0, float("inf"), 1, 1)
    low, high = _resampled_ratio_bounds(a, b, resamples=resamples, confidence=confidence, seed=seed)
    return Interval(estimate, low, high, n, n)
