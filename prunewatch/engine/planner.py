"""Choose, before a request's prefill, which decoder blocks it bypasses.

The rule (fixed per request, so the KV cache stays consistent):
1. Match the prompt to the calibrated domains by the cosine between its mean token direction and
   each domain centroid; the softmax of those cosines weights the domains' influence profiles.
2. Eligible blocks: all but the blacklisted ones and block 0, which always runs: transformers
   reads the KV cache length (and so positions and masks) from block 0's cache. When edges are
   protected the last block, a transition layer like the first, always runs too.
3. The adaptive threshold (prunewatch/engine/signals.py) turns the requested sensitivity into an effective
   one from the prompt's semantic density, its domain-match entropy and memory pressure, and marks
   transition layers (sharp changes of influence between neighbours) as protected.
4. Walk eligible blocks from least to most influential and bypass them while the bypassed
   influence stays within effective sensitivity x budget x the influence of the eligible blocks
   (protected, transition and blacklisted blocks never count towards it). Sensitivity 0 or a
   budget of 0 bypasses nothing.
5. Head gating (when the calibration has head influence): in the blocks still marked KEEP, walk
   the attention heads from the smallest calibrated write into the residual stream upwards and
   gate them while the gated influence stays within effective sensitivity x head budget x the
   total head influence. Bypassed, protected, transition and blacklisted blocks gate no head.

A bypassed block never runs for any token of the request, so its KV cache is never written nor
read: prefill and every decode step see the same stack of blocks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from prunewatch.engine.calibration import Calibration
from prunewatch.engine.errors import InvalidRequestError
from prunewatch.engine.execution import ExecutionPlan
from prunewatch.engine.signals import Signals, SignalWeights, combine

DOMAIN_SOFTMAX_TEMPERATURE = 0.05  # cosine gaps between domain centroids are a few hundredths


@dataclass(frozen=True)
class LayerDecision:
    """Why one block was kept or bypassed (logged at DETAILED)."""

    layer: int
    influence: float
    threshold: float  # the bypassed-influence budget left when this block was considered
    decision: str  # KEEP, BYPASS, PROTECTED, TRANSITION or BLACKLISTED
    heads_gated: tuple[int, ...] = ()  # attention heads not computed in a kept block


@dataclass(frozen=True)
class BypassPlan:
    plan: ExecutionPlan
    decisions: list[LayerDecision]
    domain: str | None
    domain_confidence: float
    budget: float  # effective sensitivity x influence_budget x influence of the eligible blocks
    signals: Signals
    nearest_domain_similarity: float  # cosine of the prompt to the closest domain centroid


def match_domain(calibration: Calibration, direction: torch.Tensor) -> tuple[dict[str, float], str, float, float]:
    """Softmax weights over domains from cosine similarity; returns (weights, best, its weight, its cosine)."""
    names = sorted(calibration.domains)
    centroids = torch.tensor([calibration.domains[n].centroid for n in names], dtype=torch.float32)  # (D, C)
    cos = centroids @ direction.float().cpu()  # (D,)
    weights = torch.softmax(cos / DOMAIN_SOFTMAX_TEMPERATURE, dim=0)
    best = int(torch.argmax(weights))
    return {n: float(w) for n, w in zip(names, weights)}, names[best], float(weights[best]), float(cos[best])


def validate_request(num_layers: int, sensitivity: float, blacklist: list[int]) -> None:
    if not (0.0 <= sensitivity <= 1.0) or math.isnan(sensitivity):
        raise InvalidRequestError(f"sensitivity must be within [0, 1], got {sensitivity}")
    bad = [i for i in blacklist if i < 0 or i >= num_layers]
    if bad:
        raise InvalidRequestError(
            f"layer_blacklist names layer(s) {bad} but the model has layers 0..{num_layers - 1}"
        )


def plan_bypass(
    calibration: Calibration,
    direction: torch.Tensor,
    prompt_ids: list[int],
    *,
    sensitivity: float,
    influence_budget: float,
    blacklist: list[int],
    protect_edges: bool,
    signal_weights: SignalWeights = SignalWeights(),
    memory_pressure: float = 0.0,
    head_budget: float = 0.0,
) -> BypassPlan:
    """The bypass plan for one request; see the module docstring for the rule."""
    n = calibration.num_layers
    validate_request(n, sensitivity, blacklist)
    weights, best, confidence, similarity = match_domain(calibration, direction)
    influence = [0.0] * n
    for name, weight in weights.items():
        for i, value in enumerate(calibration.domains[name].influence):
            influence[i] += weight * value
    signals = combine(sensitivity, prompt_ids, list(weights.values()), influence, memory_pressure, signal_weights)
    protected = {0, n - 1} if protect_edges else {0}
    status = {i: "KEEP" for i in range(n)}
    for i in signals.transition_layers:
        status[i] = "TRANSITION"
    for i in protected:
        status[i] = "PROTECTED"
    for i in blacklist:
        status[i] = "BLACKLISTED"
    # Only blocks that may be bypassed count: a block that can never be skipped must not enlarge the budget.
    budget = signals.effective_sensitivity * influence_budget * sum(influence[i] for i in range(n) if status[i] == "KEEP")
    left = budget
    thresholds = {i: left for i in range(n)}
    bypass: set[int] = set()
    if signals.effective_sensitivity > 0.0:
        for i in sorted((i for i in range(n) if status[i] == "KEEP"), key=lambda i: (influence[i], i)):
            thresholds[i] = left
            if influence[i] <= left:
                bypass.add(i)
                status[i] = "BYPASS"
                left -= influence[i]
            else:
                break
    gated = _gate_heads(calibration, weights, status, signals.effective_sensitivity * head_budget)
    decisions = [LayerDecision(i, influence[i], thresholds[i], status[i], tuple(sorted(gated[i]))) for i in range(n)]
    plan = ExecutionPlan(frozenset(bypass), gated_heads=tuple(frozenset(g) for g in gated) if any(gated) else ())
    return BypassPlan(plan, decisions, best, confidence, budget, signals, similarity)


def _gate_heads(calibration: Calibration, weights: dict[str, float], status: dict[int, str],
                share: float) -> list[set[int]]:
    """Per block, the heads gated within `share` of the total (domain-weighted) head influence."""
    n = calibration.num_layers
    gated: list[set[int]] = [set() for _ in range(n)]
    profiles = [calibration.domains[name].head_influence for name in weights]
    if share <= 0.0 or not profiles or any(len(p) != n for p in profiles):
        return gated
    heads = len(profiles[0][0])
    influence = [[sum(weights[name] * calibration.domains[name].head_influence[i][h] for name in weights)
                  for h in range(heads)] for i in range(n)]
    left = share * sum(sum(row) for row in influence)
    candidates = sorted((influence[i][h], i, h) for i in range(n) if status[i] == "KEEP" for h in range(heads))
    for value, i, h in candidates:
        if value > left:
            break
        gated[i].add(h)
        left -= value
    return gated
