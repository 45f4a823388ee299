"""Per-layer activation thresholds, calibrated on a corpus to reach a target sparsity (TEAL-style).

For every wrapped linear layer (decoder block x projection) the dense model is run on calibration
text and the score of each input entry is recorded: |x_i| ("magnitude", as TEAL), or
|x_i| * ||W[:, i]||_2 ("wina", which weighs an input by how much its weight column can move the
output). The threshold for a target sparsity s is the s-quantile of those scores, so zeroing the
entries at or below it zeroes a share s of them on text like the calibration text. The quantile
curve is kept on a 1% grid and interpolated, so any target in [0, 0.99] can be asked per request.

A calibration is tied to one model's weights fingerprint and to its score; the engine refuses one
made for another model.
"""

from __future__ import annotations

import bisect
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

import torch

from engine.errors import CalibrationMismatchError
from engine.execution import (
    ExecutionLedger,
    ExecutionPlan,
    InstrumentedModel,
    executing,
)
from engine.sparse.targets import DEFAULT_PROJECTIONS, find_sparse_targets, score_scale

SPARSITY_FORMAT_VERSION = 1
LEVELS: tuple[float, ...] = tuple(round(i / 100, 2) for i in range(100))  # 0.00 .. 0.99
Score = Literal["magnitude", "wina"]


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

    def layer(self, key: str) -> LayerThresholds:
        """One layer's threshold curve; raises CalibrationMismatchError when the layer is unknown."""
        if key not in self.thresholds:
            raise CalibrationMismatchError(
                f"sparsity calibration has no thresholds for layer {key}; it was made for other "
                "projections or another architecture: recalibrate")
        return LayerThresholds(tuple(self.levels), tuple(self.thresholds[key]))

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
        return cls(**raw)

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
) -> SparsityCalibration:
    """Measure every wrapped layer's input scores on the dense model and keep their quantile curves.

    token_batches: input ids, each (B, T). Rows are subsampled evenly per batch (seeded), so a long
    text cannot dominate and memory stays bounded at max_rows_per_layer rows per layer.
    """
    if score not in ("magnitude", "wina"):
        raise ValueError(f"score must be 'magnitude' or 'wina', got {score!r}")
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
    return SparsityCalibration(
        model_fingerprint=model_fingerprint,
        score=score,
        levels=list(LEVELS),
        thresholds=thresholds,
        corpus_digest=corpus_digest,
        rows_per_layer=rows,
    )


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
) -> SparsityCalibration:
    """Tokenize `texts` (one batch each, truncated) and calibrate on them."""
    batches = [tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids[:, :max_tokens_per_text]
               for text in texts]
    return calibrate_sparsity(
        instrumented, batches, model_fingerprint=model_fingerprint, corpus_digest=corpus_digest,
        score=score, projections=projections, max_rows_per_layer=max_rows_per_layer, progress=progress)
