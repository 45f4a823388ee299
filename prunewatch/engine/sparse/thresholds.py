"""Per-layer activation thresholds, measured on a corpus to reach a target sparsity (TEAL-style).

For every wrapped linear layer (decoder block x projection) the dense model is run on calibration
text and the score of each input entry is recorded: |x_i| ("magnitude", as TEAL), or
|x_i| * ||W[:, i]||_2 ("wina", which weighs an input by how much its weight column can move the
output). The threshold for a target sparsity s is the s-quantile of those scores, so zeroing the
entries at or below it zeroes a share s of them on text like the calibration text. The quantile
curve is kept on a 1% grid and interpolated, so any target in [0, 0.99] can be asked per request.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from prunewatch.engine.execution import ExecutionLedger, ExecutionPlan, InstrumentedModel, executing

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
def measure_thresholds(
    instrumented: InstrumentedModel,
    batches: Sequence[torch.Tensor],
    targets: Mapping[str, tuple[int, torch.nn.Module]],
    scales: Mapping[str, torch.Tensor],
    *,
    max_rows_per_layer: int,
    seed: int,
    progress: Callable[[int, int], None] | None = None,
) -> tuple[dict[str, list[float]], int]:
    """(layer_key -> score threshold at each of LEVELS, token rows measured per layer) on the dense model.

    batches: input ids, each (B, T), none empty. Rows are subsampled evenly per batch (seeded), so a long
    text cannot dominate and memory stays bounded at max_rows_per_layer rows per layer. scales: layer_key ->
    what its inputs' magnitudes are multiplied by (score_scale), on the model's device.
    """
    per_batch = max(1, -(-max_rows_per_layer // len(batches)))
    generator = torch.Generator().manual_seed(seed)
    collected: dict[str, list[torch.Tensor]] = {key: [] for key in targets}
    picked: dict[str, torch.Tensor] = {}

    def make_hook(key: str) -> Callable[[torch.nn.Module, tuple[torch.Tensor, ...], torch.Tensor], None]:
        def hook(module: torch.nn.Module, args: tuple[torch.Tensor, ...], output: torch.Tensor) -> None:
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
    return thresholds, rows
