"""Per-layer activation thresholds, calibrated on a corpus to reach a target sparsity (TEAL-style).

For every wrapped linear layer (decoder block x projection) the dense model is run on calibration
text and the score of each input entry is recorded: |x_i| ("magnitude", as TEAL), or
|x_i| * ||W[:, i]||_2 ("wina", which weighs an input by how much its weight column can move the
output). The threshold for a target sparsity s is the s-quantile of those scores, so zeroing the
entries at or below it zeroes a share s of them on text like the calibration text. The quantile
curve is kept on a 1% grid and interpolated, so any target in [0, 0.99] can be asked per request.

A calibration is tied to one model's weights fingerprint and to its score; the engine refuses one
made for another model.

Allocation. "uniform" (TEAL's rule) gives every layer the request's target. "greedy" also measures,
on the same calibration text, what zeroing each entry costs the model's output: (dL/dx_i * x_i)^2
summed over the entries a threshold zeroes, a second-order estimate of how much L grows. L is by
default the relative top-1/top-2 logit margin ("margin": what flips the argmax, which token agreement
counts); `GREEDY_COST` names the alternatives. Walking all (block, projection) curves at once, it
sparsifies next wherever the estimated output error grows least per weight FLOP skipped, and records
for every global target (the FLOP-weighted mean sparsity of the unprotected layers) the sparsity it
chose per layer and projection. The calibration stores that plan with the hash of the text it was
fitted on, and per layer the threshold of its allocated sparsity at each global target, so a
request's single target picks a point on the greedy path (`SparsityAllocation`).
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
import json
import logging
import math
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

import torch

from prunewatch.engine.errors import CalibrationMismatchError
from prunewatch.engine.execution import (
    ExecutionLedger,
    ExecutionPlan,
    InstrumentedModel,
    executing,
)
from prunewatch.engine.sparse.targets import (
    DEFAULT_PROJECTIONS,
    find_sparse_targets,
    in_out,
    score_scale,
)

logger = logging.getLogger(__name__)

SPARSITY_FORMAT_VERSION = 1
LEVELS: tuple[float, ...] = tuple(round(i / 100, 2) for i in range(100))  # 0.00 .. 0.99
Score = Literal["magnitude", "wina"]
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


@dataclass(frozen=True)
class LayerThresholds:
    """One wrapped layer's calibrated score thresholds: the grid, and the threshold at each level."""

    levels: tuple[float, ...]
    values: tuple[float, ...]

    def at(self, target: float) -> float:
        """Threshold for a target sparsity, linear between grid points."""
        levels, values = self.levels, self.values
        if target <= levels[0]:
            return values[0]
        if target >= levels[-1]:
            return values[-1]
        hi = bisect.bisect_right(levels, target)
        lo = hi - 1
        frac = (target - levels[lo]) / (levels[hi] - levels[lo])
        return values[lo] + frac * (values[hi] - values[lo])


@dataclass(frozen=True)
class SparsityCalibration:
    """Score thresholds per wrapped linear layer on a grid of target sparsities."""

    model_fingerprint: str  # weights fingerprint of the model it was measured on
    score: str  # "magnitude" (|x|) or "wina" (|x| * column norm of W)
    levels: list[float]  # target sparsities of the grid, ascending
    thresholds: dict[str, list[float]]  # layer_key -> score threshold at each level
    corpus_digest: str  # identifies the calibration text
    rows_per_layer: int  # token rows measured per layer (after subsampling)
    created_at: float = field(default_factory=time.time)
    format_version: int = SPARSITY_FORMAT_VERSION
    allocation: SparsityAllocation | None = None  # None: uniform (every layer gets the request's target)

    @property
    def allocation_method(self) -> str:
        return "uniform" if self.allocation is None else self.allocation.method

    def layer(self, key: str) -> LayerThresholds:
        """One layer's threshold curve over the request's target; raises CalibrationMismatchError when
        the layer is unknown. With an allocation, the curve maps a global target to the threshold of
        the sparsity the plan chose for this layer at that target."""
        if key not in self.thresholds or (self.allocation is not None and key not in self.allocation.sparsity):
            raise CalibrationMismatchError(
                f"sparsity calibration has no thresholds for layer {key}; it was made for other "
                "projections or another architecture: recalibrate")
        curve = LayerThresholds(tuple(self.levels), tuple(self.thresholds[key]))
        if self.allocation is None:
            return curve
        allocated = self.allocation.sparsity[key]
        return LayerThresholds(tuple(self.allocation.levels), tuple(curve.at(s) for s in allocated))

    def threshold(self, key: str, target: float) -> float:
        """Score threshold of one layer for a target sparsity, interpolated on the grid."""
        return self.layer(key).at(target)

    def check_model(self, fingerprint: str) -> None:
        if self.model_fingerprint != fingerprint:
            raise CalibrationMismatchError(
                f"sparsity calibration was made for model fingerprint {self.model_fingerprint[:12]}, "
                f"not for this model ({fingerprint[:12]}); recalibrate the activation thresholds")

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, raw: dict) -> SparsityCalibration:
        if raw.get("format_version") != SPARSITY_FORMAT_VERSION:
            raise CalibrationMismatchError(
                f"sparsity calibration has format {raw.get('format_version')}, expected "
                f"{SPARSITY_FORMAT_VERSION}; recalibrate")
        if raw.get("score") not in ("magnitude", "wina"):
            raise CalibrationMismatchError(f"sparsity calibration has unknown score {raw.get('score')!r}")
        levels = raw.get("levels") or []
        if any(len(curve) != len(levels) for curve in raw.get("thresholds", {}).values()):
            raise CalibrationMismatchError("sparsity calibration is corrupt: a threshold curve does not match its levels")
        raw = dict(raw)
        allocation = raw.pop("allocation", None)
        if allocation is not None:
            try:
                allocation = SparsityAllocation(**allocation)
            except TypeError as exc:
                raise CalibrationMismatchError(f"sparsity calibration has a corrupt allocation: {exc}") from None
            if any(len(curve) != len(allocation.levels) for curve in allocation.sparsity.values()):
                raise CalibrationMismatchError("sparsity calibration is corrupt: an allocation does not match its levels")
        return cls(**raw, allocation=allocation)

    def save(self, path: Path) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(json.dumps(self.to_dict()) + "\n")
        tmp.replace(path)  # atomic: a crash never leaves half a calibration

    @classmethod
    def load(cls, path: Path) -> SparsityCalibration:
        try:
            raw = json.loads(Path(path).read_text())
        except (OSError, ValueError) as exc:
            raise CalibrationMismatchError(f"cannot read sparsity calibration {path}: {exc}") from exc
        return cls.from_dict(raw)


_QUANTILE_SAMPLE = 1 << 17  # a 1% grid needs no more: the standard error of a quantile is < 0.002


def _quantile_curve(values: torch.Tensor, levels: Sequence[float], generator: torch.Generator) -> list[float]:
    """Linear-interpolated quantiles of a 1-D tensor at `levels` (torch.quantile caps input size)."""
    if values.numel() > _QUANTILE_SAMPLE:
        values = values[torch.randint(0, values.numel(), (_QUANTILE_SAMPLE,), generator=generator)]
    ordered = torch.sort(values).values  # (N,)
    pos = torch.tensor(levels, dtype=torch.float64) * (ordered.numel() - 1)
    lo = pos.floor().long()
    hi = torch.clamp(lo + 1, max=ordered.numel() - 1)
    lo_v, hi_v = ordered[lo].double(), ordered[hi].double()
    return (lo_v + (pos - lo) * (hi_v - lo_v)).tolist()


@torch.no_grad()
def calibrate_sparsity(
    instrumented: InstrumentedModel,
    token_batches: Sequence[torch.Tensor],
    *,
    model_fingerprint: str,
    corpus_digest: str,
    score: Score = "magnitude",
    projections: Sequence[str] = DEFAULT_PROJECTIONS,
    max_rows_per_layer: int = 512,
    seed: int = 0,
    progress: Callable[[int, int], None] | None = None,
    allocation: Allocation = "uniform",
    protected_layers: Collection[int] = (),
    max_sparsity: float = MAX_ALLOCATED,
    text_sha256: str | None = None,
    cost: Cost | None = None,
) -> SparsityCalibration:
    """Measure every wrapped layer's input scores on the dense model and keep their quantile curves.

    token_batches: input ids, each (B, T). Rows are subsampled evenly per batch (seeded), so a long
    text cannot dominate and memory stays bounded at max_rows_per_layer rows per layer.
    allocation="greedy" also measures each layer's estimated output-error curve on the same batches
    (one forward and backward pass each) and stores the greedy plan (`greedy_allocation`), which
    gives `protected_layers` nothing; text_sha256 names the text (default: a hash of the token ids).
    """
    if score not in ("magnitude", "wina"):
        raise ValueError(f"score must be 'magnitude' or 'wina', got {score!r}")
    if allocation not in ("uniform", "greedy"):
        raise ValueError(f"allocation must be 'uniform' or 'greedy', got {allocation!r}")
    cost = cost or GREEDY_COST
    if cost not in ("fisher", "empirical-fisher", "margin", "kl-blocks"):
        raise ValueError(f"cost must be 'fisher', 'empirical-fisher', 'margin' or 'kl-blocks', got {cost!r}")
    batches = [b for b in token_batches if b.numel() > 0]
    if not batches:
        raise ValueError("sparsity calibration needs at least one non-empty batch of token ids")
    targets = find_sparse_targets(instrumented, projections)
    scales = {key: score_scale(module, score).to(module.weight.device)  # multiplies inputs on the model's device
              for key, (_, module) in targets.items()}
    per_batch = max(1, -(-max_rows_per_layer // len(batches)))
    generator = torch.Generator().manual_seed(seed)
    collected: dict[str, list[torch.Tensor]] = {key: [] for key in targets}
    picked: dict[str, torch.Tensor] = {}

    def make_hook(key: str):
        def hook(module, args, output):
            x = args[0].reshape(-1, args[0].shape[-1])  # (B*T, in): every target sees the same rows
            collected[key].append((x[picked["rows"]].float().abs() * scales[key]).cpu())

        return hook

    handles = [module.register_forward_hook(make_hook(key)) for key, (_, module) in targets.items()]
    device = next(instrumented.model.parameters()).device
    try:
        for done, ids in enumerate(batches, start=1):
            total_rows = ids.numel()
            picked["rows"] = torch.randperm(total_rows, generator=generator)[: min(per_batch, total_rows)].sort().values
            with executing(ExecutionPlan(), ExecutionLedger()):  # calibration work is nobody's request
                instrumented.model(input_ids=ids.to(device), use_cache=False)
            if progress is not None:
                progress(done, len(batches))
    finally:
        for handle in handles:
            handle.remove()
    thresholds = {key: _quantile_curve(torch.cat(parts).flatten(), LEVELS, generator) for key, parts in collected.items()}
    rows = sum(part.shape[0] for part in next(iter(collected.values())))
    plan = None
    if allocation == "greedy":
        within = "fisher" if cost == "kl-blocks" else cost
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
        plan = SparsityAllocation(method="greedy", cost=cost, levels=global_levels, sparsity=chosen,
                                  protected_layers=protected, max_sparsity=max_sparsity, text_sha256=digest,
                                  tokens=tokens)
    return SparsityCalibration(
        model_fingerprint=model_fingerprint,
        score=score,
        levels=list(LEVELS),
        thresholds=thresholds,
        corpus_digest=corpus_digest,
        rows_per_layer=rows,
        allocation=plan,
    )


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


def calibrate_sparsity_on_texts(
    instrumented: InstrumentedModel,
    tokenizer,
    texts: Sequence[str],
    *,
    model_fingerprint: str,
    corpus_digest: str,
    score: Score = "magnitude",
    projections: Sequence[str] = DEFAULT_PROJECTIONS,
    max_tokens_per_text: int = 256,
    max_rows_per_layer: int = 512,
    progress: Callable[[int, int], None] | None = None,
    allocation: Allocation = "uniform",
    protected_layers: Collection[int] = (),
    seed: int = 0,
) -> SparsityCalibration:
    """Tokenize `texts` (one batch each, truncated) and calibrate on them."""
    batches = [tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids[:, :max_tokens_per_text]
               for text in texts]
    return calibrate_sparsity(
        instrumented, batches, model_fingerprint=model_fingerprint, corpus_digest=corpus_digest,
        score=score, projections=projections, max_rows_per_layer=max_rows_per_layer, progress=progress,
        allocation=allocation, protected_layers=protected_layers, seed=seed, text_sha256=text_digest(texts))


def text_digest(texts: Sequence[str]) -> str:
    """sha256 of calibration texts, in order, joined by NUL."""
    return hashlib.sha256("\0".join(texts).encode("utf-8")).hexdigest()


def sparsity_protected_layers(settings, calibration=None) -> list[int]:
    """Blocks a request never sparsifies, known before any request: the blacklisted blocks and every
    block that is a transition layer for some calibrated domain (prunewatch.engine.signals.transition_layers).

    settings: EngineSettings; calibration: the block calibration (prunewatch.engine.calibration.Calibration) or None.
    """
    from prunewatch.engine.signals import transition_layers

    protected = set(settings.layer_blacklist)
    if calibration is not None:
        for profile in calibration.domains.values():
            protected.update(transition_layers(profile.influence, settings.signal_weights.transition_change_rate))
    return sorted(protected)


def sparsity_calibration_path(block_calibration_path: Path, allocation: str, score: str) -> Path:
    """Where the thresholds are cached beside the block calibration; uniform magnitude keeps the old name."""
    kind = "" if (allocation, score) == ("uniform", "magnitude") else f".{allocation}-{score}"
    return block_calibration_path.with_name(f"{block_calibration_path.stem}{kind}.sparsity.json")


def load_or_calibrate_sparsity(engine, texts_by_domain: Mapping[str, Sequence[str]],
                               corpus_digest: str) -> SparsityCalibration:
    """The engine's activation thresholds for its settings' allocation and score: the cached file when it
    was made for this model, score, allocation and protected blocks, else calibrated on the domains'
    texts and cached. engine: a PruningEngine (not imported: it imports this module)."""
    settings = engine.settings
    allocation, score = settings.sparsity_allocation, settings.sparsity_score
    protected = sparsity_protected_layers(settings, engine.calibration) if allocation == "greedy" else []
    path = sparsity_calibration_path(engine.calibration_path(corpus_digest), allocation, score)
    if path.is_file():
        cached = SparsityCalibration.load(path)
        if (cached.score == score and cached.allocation_method == allocation
                and (cached.allocation is None or (cached.allocation.protected_layers == protected
                                                   and cached.allocation.cost == GREEDY_COST))):
            return cached
        logger.info("sparsity calibration %s was made for other settings; recalibrating", path)
    texts = [text for domain in sorted(texts_by_domain) for text in texts_by_domain[domain]]
    calibration = calibrate_sparsity_on_texts(
        engine.instrumented, engine.loaded.tokenizer, texts, model_fingerprint=engine.loaded.fingerprint,
        corpus_digest=corpus_digest, score=score, allocation=allocation, protected_layers=protected)
    calibration.save(path)
    return calibration
