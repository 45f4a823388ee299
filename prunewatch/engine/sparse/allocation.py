"""How a request's single sparsity target is spread over the layers: the allocation of a sparsity calibration.

"uniform" (TEAL's rule) gives every layer the request's target. "greedy" also measures, on the
calibration text, what zeroing each entry costs the model's output: (dL/dx_i * x_i)^2 summed over
the entries a threshold zeroes, a second-order estimate of how much L grows. L is by default the
relative top-1/top-2 logit margin ("margin": what flips the argmax, which token agreement counts);
`GREEDY_COST` names the alternatives. Walking all (block, projection) curves at once, it sparsifies
next wherever the estimated output error grows least per weight FLOP skipped, and records for every
global target (the FLOP-weighted mean sparsity of the unprotected layers) the sparsity it chose per
layer and projection. The calibration stores that plan with the hash of the text it was fitted on,
and per layer the threshold of its allocated sparsity at each global target, so a request's single
target picks a point on the greedy path (`SparsityAllocation`).
"""

from __future__ import annotations

import hashlib
import itertools
import math
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import torch

from prunewatch.engine.execution import ExecutionLedger, ExecutionPlan, InstrumentedModel, executing
from prunewatch.engine.sparse.targets import in_out
from prunewatch.engine.sparse.thresholds import LEVELS, LayerThresholds

if TYPE_CHECKING:
    from prunewatch.engine.calibration import Calibration
    from prunewatch.engine.settings import EngineSettings

Allocation = Literal["uniform", "greedy"]
MAX_ALLOCATED = 0.9  # highest sparsity the greedy plan gives one projection: beyond it outputs degrade abruptly
Cost = Literal["fisher", "empirical-fisher", "margin", "kl-blocks"]
BLOCK_PROBE_LEVELS: tuple[float, ...] = (0.15, 0.3, 0.5)  # "kl-blocks": where each block's KL is measured
GREEDY_COST: Cost = "margin"
"""The output-error estimate the greedy plan minimises (see `_output_error_curves`). On SmolLM2-135M-Instruct
at target 0.3 (decode ratio 0.13, the 6 probes x 32 tokens) token agreement was 0.901 uniform, 0.953
"fisher", 0.969 "margin"; "kl-blocks" (measured KL per block) chose the "fisher" plan again at ~7x the
calibration time. Exploratory runs of one session, not the committed frontier."""


@dataclass(frozen=True)
class SparsityAllocation:
    """The greedy plan: for each global target, the sparsity chosen per layer and projection."""

    method: str  # "greedy": cheapest estimated output error per skipped weight FLOP first
    cost: str  # "fisher": sum over zeroed entries of (dL/dx_i * x_i)^2 on the calibration text
    levels: list[float]  # global targets: FLOP-weighted mean sparsity of the unprotected layers' projections
    sparsity: dict[str, list[float]]  # layer_key -> its sparsity at each global target
    protected_layers: list[int]  # decoder blocks allocated nothing (transition and blacklisted blocks)
    max_sparsity: float  # cap per projection
    text_sha256: str  # sha256 of the calibration texts the costs were measured on (joined by NUL)
    tokens: int  # tokens the costs were measured on

    def at(self, key: str, target: float) -> float:
        """The sparsity of one layer for a global target, linear between the plan's levels."""
        return LayerThresholds(tuple(self.levels), tuple(self.sparsity[key])).at(target)

    def plan_at(self, target: float) -> dict[str, float]:
        """layer_key -> sparsity for a global target."""
        return {key: round(self.at(key, target), 4) for key in self.sparsity}


def greedy_plan(
    instrumented: InstrumentedModel,
    batches: Sequence[torch.Tensor],
    targets: Mapping[str, tuple[int, torch.nn.Module]],
    scales: Mapping[str, torch.Tensor],
    thresholds: Mapping[str, list[float]],
    *,
    cost: Cost,
    protected_layers: Collection[int],
    max_sparsity: float,
    text_sha256: str | None,
    seed: int,
    progress: Callable[[int, int], None] | None = None,
) -> SparsityAllocation:
    """The greedy allocation of the layers' calibrated `thresholds` (layer_key -> threshold at each of LEVELS):
    each layer's estimated output-error curve measured on `batches` (one forward and backward pass each), then
    `greedy_allocation` across the layers, which gives `protected_layers` nothing ("kl-blocks": re-spread across
    blocks by measured KL). text_sha256 names the text (None: a hash of the token ids)."""
    within: Cost = "fisher" if cost == "kl-blocks" else cost
    costs, tokens = _output_error_curves(instrumented, batches, targets, scales, LEVELS, within, seed)
    weights = {key: float(math.prod(in_out(module))) for key, (_, module) in targets.items()}
    protected = sorted({int(i) for i in protected_layers})
    eligible = [key for key, (layer, _) in targets.items() if layer not in protected]
    global_levels = [level for level in LEVELS if level <= max_sparsity]
    chosen = greedy_allocation(costs, weights, eligible, LEVELS, global_levels, max_sparsity)
    if cost == "kl-blocks":
        curves = {key: LayerThresholds(tuple(LEVELS), tuple(values)) for key, values in thresholds.items()}
        chosen = _allocate_blocks_by_kl(instrumented, batches, targets, scales, curves, chosen, global_levels,
                                        weights, protected, max_sparsity, progress)
    digest = text_sha256 or hashlib.sha256(b"".join(ids.cpu().numpy().tobytes() for ids in batches)).hexdigest()
    return SparsityAllocation(method="greedy", cost=cost, levels=global_levels, sparsity=chosen,
                              protected_layers=protected, max_sparsity=max_sparsity, text_sha256=digest,
                              tokens=tokens)




def _output_error_curves(instrumented: InstrumentedModel, batches: Sequence[torch.Tensor],
                         targets: Mapping[str, tuple[int, torch.nn.Module]], scales: Mapping[str, torch.Tensor],
                         levels: Sequence[float], cost: Cost = "fisher", seed: int = 0,
                         ) -> tuple[dict[str, list[float]], int]:
    """Per layer, the estimated output error (per token) of zeroing its lowest-scored input entries at
    each level: sum of (dL/dx_i * x_i)^2 over the zeroed entries, the second-order (Fisher) estimate
    of how much L grows. L is, by `cost`:
    - "fisher": -log p(y) for y sampled from the dense model's own next-token distribution (seeded),
      whose squared gradient estimates the Fisher information, i.e. the KL divergence from the dense
      output distribution;
    - "empirical-fisher": -log p(next token of the text);
    - "margin": the top-1 minus top-2 logit, relative to its dense value, summed over positions: a
      change that closes a small margin flips the argmax, which is what token agreement counts.

    Each target's input gets a zero tensor added (a forward pre-hook) whose gradient is dL/dx of that
    layer alone; the graph upstream is left whole, so every layer's gradient is the dense model's.
    """
    scores: dict[str, list[torch.Tensor]] = {key: [] for key in targets}
    saliency: dict[str, list[torch.Tensor]] = {key: [] for key in targets}
    inputs: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def make_hook(key: str):
        def hook(module, args):
            probe = torch.zeros_like(args[0], requires_grad=True)
            inputs[key] = (args[0].detach(), probe)
            return (args[0] + probe, *args[1:])

        return hook

    handles = [module.register_forward_pre_hook(make_hook(key)) for key, (_, module) in targets.items()]
    device = next(instrumented.model.parameters()).device
    tokens = 0
    generator = torch.Generator().manual_seed(seed)
    try:
        for ids in batches:
            if ids.shape[-1] < 2:
                continue
            ids = ids.to(device)
            inputs.clear()
            with torch.enable_grad(), executing(ExecutionPlan(), ExecutionLedger()):
                logits = instrumented.model(input_ids=ids, use_cache=False).logits[:, :-1].float()  # (B, T-1, V)
                flat = logits.reshape(-1, logits.shape[-1])  # (N, V)
                if cost == "empirical-fisher":
                    loss = torch.nn.functional.cross_entropy(flat, ids[:, 1:].reshape(-1), reduction="sum")
                elif cost == "fisher":
                    probs = torch.softmax(flat.detach(), dim=-1).cpu()
                    sampled = torch.multinomial(probs, 1, generator=generator).reshape(-1).to(flat.device)
                    loss = torch.nn.functional.cross_entropy(flat, sampled, reduction="sum")
                else:
                    top2 = torch.topk(flat.detach(), 2, dim=-1).indices  # (N, 2)
                    picked = flat.gather(1, top2)  # (N, 2)
                    margin = picked[:, 0] - picked[:, 1]
                    loss = (margin / margin.detach().clamp_min(0.25)).sum()
                keys = list(inputs)
                grads = torch.autograd.grad(loss, [inputs[key][1] for key in keys])
            for key, grad in zip(keys, grads):
                x = inputs[key][0]
                scores[key].append((x.float().abs() * scales[key]).flatten().cpu())
                saliency[key].append((grad.float() * x.float()).pow(2).flatten().cpu())
            tokens += int(ids[:, 1:].numel())
    finally:
        for handle in handles:
            handle.remove()
    if tokens == 0:
        raise ValueError("greedy allocation needs calibration text of at least two tokens")
    curves: dict[str, list[float]] = {}
    for key in targets:
        order = torch.argsort(torch.cat(scores[key]), stable=True)
        cumulative = torch.cumsum(torch.cat(saliency[key])[order].double(), dim=0)  # (N,) lowest scores first
        count = cumulative.numel()
        curves[key] = [float(cumulative[int(level * count) - 1]) / tokens if int(level * count) > 0 else 0.0
                       for level in levels]
    return curves, tokens


@torch.no_grad()
def _allocate_blocks_by_kl(instrumented: InstrumentedModel, batches: Sequence[torch.Tensor],
                           targets: Mapping[str, tuple[int, torch.nn.Module]], scales: Mapping[str, torch.Tensor],
                           curves: Mapping[str, LayerThresholds], within: Mapping[str, list[float]],
                           levels: Sequence[float], weights: Mapping[str, float], protected: Collection[int],
                           max_sparsity: float, progress: Callable[[int, int], None] | None = None,
                           ) -> dict[str, list[float]]:
    """Re-spread a plan across blocks by measured output error, keeping its split within each block.

    For each unprotected block b and probe level t (BLOCK_PROBE_LEVELS), only block b is sparsified as
    `within` says at global target t, and the KL divergence of the model's next-token distribution
    from the dense one is measured on the calibration batches. Those per-block curves (cost against
    the block's FLOP-weighted mean sparsity, extrapolated quadratically to the cap) go through
    `greedy_allocation` across blocks; a block's share then maps back to the target t whose
    within-block split it takes.
    """
    device = next(instrumented.model.parameters()).device
    dense = []
    with executing(ExecutionPlan(), ExecutionLedger()):
        for ids in batches:
            logits = instrumented.model(input_ids=ids.to(device), use_cache=False).logits[:, :-1].float()
            dense.append(torch.log_softmax(logits.reshape(-1, logits.shape[-1]), dim=-1))  # (B*(T-1), V)
    tokens = sum(d.shape[0] for d in dense)
    active: dict[str, float] = {}

    def make_hook(key: str):
        def hook(module, args):
            threshold = active.get(key)
            if threshold is None:
                return None
            x = args[0]
            return (x * ((x.abs().float() * scales[key]) > threshold).to(x.dtype), *args[1:])

        return hook

    handles = [module.register_forward_pre_hook(make_hook(key)) for key, (_, module) in targets.items()]
    blocks = sorted({layer for layer, _ in targets.values()} - set(protected))
    keys_of = {b: [key for key, (layer, _) in targets.items() if layer == b] for b in blocks}
    plan_levels = list(levels)

    def block_mean(b: int, index: int) -> float:
        return sum(within[k][index] * weights[k] for k in keys_of[b]) / sum(weights[k] for k in keys_of[b])

    def level_index(t: float) -> int:
        return min(range(len(plan_levels)), key=lambda i: abs(plan_levels[i] - t))

    block_costs: dict[str, list[float]] = {}
    block_levels: dict[str, list[float]] = {}
    try:
        for done, b in enumerate(blocks, start=1):
            points = [(0.0, 0.0)]
            for t in BLOCK_PROBE_LEVELS:
                index = level_index(t)
                active.clear()
                active.update({k: curves[k].at(within[k][index]) for k in keys_of[b]})
                kl = 0.0
                with executing(ExecutionPlan(), ExecutionLedger()):
                    for ids, reference in zip(batches, dense):
                        logits = instrumented.model(input_ids=ids.to(device), use_cache=False).logits[:, :-1].float()
                        pruned = torch.log_softmax(logits.reshape(-1, logits.shape[-1]), dim=-1)
                        kl += float(torch.nn.functional.kl_div(pruned, reference,
                                                               log_target=True, reduction="sum"))
                points.append((block_mean(b, index), max(kl / tokens, points[-1][1])))
            top_level, top_cost = points[-1]
            cap = block_mean(b, len(plan_levels) - 1)
            if cap > top_level + 1e-6 and top_level > 0:
                points.append((cap, top_cost * (cap / top_level) ** 2))
            block_levels[str(b)] = [p[0] for p in points]
            block_costs[str(b)] = [p[1] for p in points]
            if progress is not None:
                progress(done, len(blocks))
    finally:
        active.clear()
        for handle in handles:
            handle.remove()
    block_weights = {str(b): sum(weights[k] for k in keys_of[b]) for b in blocks}
    reachable = [level for level in levels if level <= max_sparsity]
    shares = greedy_allocation(block_costs, block_weights, list(block_costs), block_levels, reachable, max_sparsity)
    plan = {key: [0.0] * len(levels) for key in targets}
    for b in blocks:
        means = [block_mean(b, i) for i in range(len(plan_levels))]  # ascending in the global target
        for j, share in enumerate(shares[str(b)]):
            # the global target whose within-block split has this block mean (linear between grid points)
            hi = next((i for i, m in enumerate(means) if m >= share - 1e-12), len(means) - 1)
            lo = max(0, hi - 1)
            frac = 0.0 if means[hi] == means[lo] else min(1.0, max(0.0, (share - means[lo]) / (means[hi] - means[lo])))
            for key in keys_of[b]:
                plan[key][j] = round(within[key][lo] + frac * (within[key][hi] - within[key][lo]), 4)
    return plan


def _lower_hull(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Lower convex hull of points sorted by x (Andrew's monotone chain)."""
    hull: list[tuple[float, float]] = []
    for point in points:
        while len(hull) >= 2:
            (x1, y1), (x2, y2) = hull[-2], hull[-1]
            if (x2 - x1) * (point[1] - y1) - (y2 - y1) * (point[0] - x1) <= 0:  # hull[-1] lies above the chord
                hull.pop()
            else:
                break
        hull.append(point)
    return hull


def greedy_allocation(costs: Mapping[str, Sequence[float]], weights: Mapping[str, float], eligible: Collection[str],
                      levels: Sequence[float] | Mapping[str, Sequence[float]], targets: Sequence[float], max_sparsity: float = MAX_ALLOCATED,
                      ) -> dict[str, list[float]]:
    """Per layer, the sparsity at each global target when sparsity always grows where the cost grows least.

    costs: layer_key -> cost at each of `levels` (ascending, from 0; or a mapping of each key's own
    levels); weights: layer_key -> weight
    FLOPs per token row (what one unit of its sparsity skips); eligible: the keys that may be
    sparsified (every other key gets 0). A global target t is the weight-weighted mean sparsity of
    the eligible keys. Each curve is replaced by its lower convex hull (a cost that drops later is
    worth reaching through the step before), and hull segments are taken in order of cost per
    FLOP skipped, ties by key: the same inputs always give the same plan.
    """
    if any(not 0.0 <= t <= max_sparsity + 1e-9 for t in targets):
        raise ValueError(f"global targets must lie in [0, {max_sparsity}]")
    chosen_keys = [key for key in sorted(eligible) if weights.get(key, 0.0) > 0]
    segments: list[tuple[float, str, float, float]] = []  # (cost per FLOP, key, from, to)
    for key in chosen_keys:
        curve = list(costs[key])
        points, best = [], 0.0
        for level, cost in zip(levels[key] if isinstance(levels, Mapping) else levels, curve):
            if level > max_sparsity + 1e-9:
                break
            best = max(best, float(cost))  # costs only grow with sparsity
            points.append((float(level), best))
        hull = _lower_hull(points)
        for (x0, y0), (x1, y1) in itertools.pairwise(hull):
            segments.append(((y1 - y0) / ((x1 - x0) * weights[key]), key, x0, x1))
    segments.sort()
    total = sum(weights[key] for key in chosen_keys)
    current = {key: 0.0 for key in costs}
    plan: dict[str, list[float]] = {key: [] for key in costs}
    saved, index = 0.0, 0
    for target in sorted(targets):
        goal = target * total
        while index < len(segments):
            _, key, x0, x1 = segments[index]
            step = (x1 - x0) * weights[key]
            if saved + step > goal + 1e-9 * total:
                current[key] = x0 + (goal - saved) / weights[key] if goal > saved else current[key]
                break
            saved += step
            current[key] = x1
            index += 1
        for key in costs:
            plan[key].append(round(current[key], 4))
    order = sorted(range(len(targets)), key=lambda i: targets[i])
    return {key: [values[order.index(i)] for i in range(len(targets))] for key, values in plan.items()}


def sparsity_protected_layers(settings: EngineSettings, calibration: Calibration | None = None) -> list[int]:
    """Blocks a request never sparsifies, known before any request: the blacklisted blocks and every
    block that is a transition layer for some calibrated domain (prunewatch.engine.signals.transition_layers).
    calibration: the block calibration, or None."""
    from prunewatch.engine.signals import transition_layers

    protected = set(settings.layer_blacklist)
    if calibration is not None:
        for profile in calibration.domains.values():
            protected.update(transition_layers(profile.influence, settings.signal_weights.transition_change_rate))
    return sorted(protected)
