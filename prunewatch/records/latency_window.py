"""Pruned against dense per-token time of one (target, model, domain), paired by prompt, with 95% intervals.

"Pruning made it slower than dense" is a claim about two timings of the same prompt on the same target, so
it is read on pairs: in a baseline round every probe runs pruned and dense back to back
(collector/probe_round.py), and each such pair gives one pruned and one dense time per token. The figure is
the ratio of the summed pruned times over the summed dense times of the pairs of the last `window_rounds`
baseline rounds, with an interval bootstrapped over pairs (records/intervals.py). Pairing keeps a host's load,
which moves both runs of a pair, out of the ratio; the interval keeps a handful of noisy pairs from paging
anyone: the latency rules fire only when even its lower bound is above the model's measured threshold.

Per token, so the figure does not move with answer length: time per output token after the first (decode) and
time to first token per prompt token (first_token). The collector exports these (records/metrics.py) and the
embedded evaluator replays them from stored results the same way (alerts/_series.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from prunewatch.records.intervals import Interval, bootstrap_ratio
from prunewatch.records.results import ProbeResult


def time_per_output_token_s(r: ProbeResult) -> float | None:
    """Decode seconds per token after the first: the engine's figure, else the collector's (HTTP, network
    included); None when the answer had one token or none."""
    rate = r.decode_tokens_per_s or r.client_decode_tokens_per_s
    return 1.0 / rate if rate else None


def ttft_per_prompt_token_s(r: ProbeResult) -> float | None:
    """Time to first token over prompt tokens: the engine's figure, else the collector's (HTTP)."""
    ttft = r.ttft_ms if r.ttft_ms is not None else r.client_ttft_ms
    return ttft / 1000.0 / r.prompt_tokens if ttft is not None and r.prompt_tokens else None


PHASES: dict[str, Callable[[ProbeResult], float | None]] = {
    "decode": time_per_output_token_s,
    "first_token": ttft_per_prompt_token_s,
}
"""The per-token times compared with dense, by the `phase` label they are exported under."""

WINDOW_BASELINE_ROUNDS = 6
"""Baseline rounds of pairs an estimate pools: at the default cadence (a baseline every 10th 30 s round) about
half an hour, within the latency rules' one-hour view."""


def _times(result: ProbeResult) -> dict[str, float]:
    out = {}
    for phase, value_of in PHASES.items():
        value = value_of(result)
        if value is not None and value > 0:
            out[phase] = value
    return out


@dataclass
class LatencyWindow:
    """The pairs of one (target, model, domain): per baseline round, (pruned, dense) times per phase."""

    window_rounds: int = WINDOW_BASELINE_ROUNDS
    sensitivity: float | None = None  # of the pruned side: pairs at another setting are not evidence of this one
    pairs: dict[str, list[tuple[dict[str, float], dict[str, float]]]] = field(default_factory=dict)  # by round
    _round: str | None = None
    _pending: dict[tuple[str, int, bool], tuple[dict[str, float], float | None]] = field(default_factory=dict)
    # unmatched runs of the current round: (probe id, version, baseline) -> (times, sensitivity)

    def add(self, result: ProbeResult) -> bool:
        """Take one result; True when it completed a pair (the estimate changed)."""
        if not result.ok or result.fallback_reason:
            return False
        if result.round_id != self._round:  # rounds of a target are sequential: an unmatched run stays unmatched
            self._round = result.round_id
            self._pending.clear()
        times = _times(result)
        if not times:
            return False
        mine = (times, result.sensitivity)
        other = self._pending.pop((result.probe_id, result.probe_version, not result.baseline), None)
        if other is None:
            self._pending[(result.probe_id, result.probe_version, result.baseline)] = mine
            return False
        (pruned, sensitivity), (dense, _) = (other, mine) if result.baseline else (mine, other)
        if sensitivity != self.sensitivity:  # another setting: the pairs so far timed the old one
            self.pairs.clear()
            self.sensitivity = sensitivity
        self.pairs.setdefault(result.round_id, []).append((pruned, dense))
        while len(self.pairs) > self.window_rounds:  # dicts keep insertion order: the oldest round goes first
            del self.pairs[next(iter(self.pairs))]
        return True

    def ratio(self, phase: str) -> Interval | None:
        """Pruned over dense time per token of `phase`, pooled over the window's pairs; None without pairs."""
        if phase not in PHASES:
            raise ValueError(f"unknown phase {phase!r}; expected one of {', '.join(PHASES)}")
        both = [(p[phase], d[phase]) for pairs in self.pairs.values() for p, d in pairs if phase in p and phase in d]
        return bootstrap_ratio([p for p, _ in both], [d for _, d in both])


class LatencyWindows:
    """A LatencyWindow per (target, model, domain), fed result by result."""

    def __init__(self, window_rounds: int = WINDOW_BASELINE_ROUNDS) -> None:
        self.window_rounds = window_rounds
        self.windows: dict[tuple[str, str, str], LatencyWindow] = {}

    def add(self, result: ProbeResult) -> LatencyWindow | None:
        """Take one result; the window whose estimate it changed, or None."""
        key = (result.target, result.model, result.domain)
        window = self.windows.get(key)
        if window is None:
            window = self.windows[key] = LatencyWindow(self.window_rounds)
        return window if window.add(result) else None
