"""A sparsity calibration: per-layer activation thresholds (prunewatch.engine.sparse.thresholds) and, with
allocation="greedy", how a request's target is spread over the layers (prunewatch.engine.sparse.allocation),
measured together on one corpus and kept as one record.

A calibration is tied to one model's weights fingerprint and to its score; the engine refuses one
made for another model. Where it is cached: prunewatch.engine.sparse.calibration_cache.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, cast

import torch

from prunewatch.engine.errors import CalibrationMismatchError
from prunewatch.engine.execution import InstrumentedModel
from prunewatch.engine.paths import write_text_atomically
from prunewatch.engine.sparse.allocation import (
    GREEDY_COST,
    MAX_ALLOCATED,
    Allocation,
    Cost,
    SparsityAllocation,
    greedy_plan,
)
from prunewatch.engine.sparse.targets import DEFAULT_PROJECTIONS, find_sparse_targets, score_scale
from prunewatch.engine.sparse.thresholds import LEVELS, LayerThresholds, Score, measure_thresholds

SPARSITY_FORMAT_VERSION = 1


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

    def layer_sparsity(self, key: str) -> LayerThresholds:
        """One layer's own sparsity over the request's target: the allocation's choice for it, or the target
        itself (uniform). Raises CalibrationMismatchError when the layer is unknown."""
        self.layer(key)
        if self.allocation is None:
            return LayerThresholds((0.0, 1.0), (0.0, 1.0))
        return LayerThresholds(tuple(self.allocation.levels), tuple(self.allocation.sparsity[key]))

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
        write_text_atomically(Path(path), json.dumps(self.to_dict()) + "\n")  # a crash never leaves half of it

    @classmethod
    def load(cls, path: Path) -> SparsityCalibration:
        try:
            raw = json.loads(Path(path).read_text())
        except (OSError, ValueError) as exc:
            raise CalibrationMismatchError(f"cannot read sparsity calibration {path}: {exc}") from exc
        return cls.from_dict(raw)



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
    (one forward and backward pass each) and stores the greedy plan (prunewatch.engine.sparse.allocation), which
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
    scales = {key: score_scale(module, score).to(cast(torch.Tensor, module.weight).device)  # on the model's device
              for key, (_, module) in targets.items()}
    thresholds, rows = measure_thresholds(instrumented, batches, targets, scales,
                                          max_rows_per_layer=max_rows_per_layer, seed=seed, progress=progress)
    plan = None
    if allocation == "greedy":
        plan = greedy_plan(instrumented, batches, targets, scales, thresholds, cost=cost,
                           protected_layers=protected_layers, max_sparsity=max_sparsity, text_sha256=text_sha256,
                           seed=seed, progress=progress)
    return SparsityCalibration(
        model_fingerprint=model_fingerprint,
        score=score,
        levels=list(LEVELS),
        thresholds=thresholds,
        corpus_digest=corpus_digest,
        rows_per_layer=rows,
        allocation=plan,
    )


def calibrate_sparsity_on_texts(
    instrumented: InstrumentedModel,
    tokenizer: Any,  # transformers PreTrainedTokenizerBase
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

