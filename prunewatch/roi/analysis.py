"""Views derived from one ROI result: sensitivity, savings waterfall, cumulative projection (pure)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from prunewatch.roi.costs import DAYS_PER_MONTH, Basis, RoiResult, compute
from prunewatch.roi.errors import RoiError
from prunewatch.roi.inputs import ResolvedInputs
from prunewatch.roi.provenance import Provenance

_BOUNDS: dict[str, tuple[float, float]] = {
    "gpu_utilisation": (0.01, 1.0),
    "failure_rate": (0.0, 1.0),
    "prunable_time_share": (0.0, 1.0),
    "pruning_ratio": (0.0, 1.0),
    "time_factor": (1e-6, float("inf")),
    "dense_inference_s": (1e-9, float("inf")),
    "pruned_inference_s": (1e-9, float("inf")),
    "dense_tokens_per_s": (1e-9, float("inf")),
    "pruned_tokens_per_s": (1e-9, float("inf")),
}
# implementation cost changes payback, never savings; the concurrency picks a measured level, and a 20% move of it
# is not a level the load run measured (the tokens/s it selected are moved on their own rows)
_NOT_SAVINGS = {"implementation_cost_usd", "concurrency"}


class SensitivityRow(BaseModel):
    """Monthly savings when one input moves down and up by the same share, the others fixed."""

    model_config = ConfigDict(frozen=True)

    key: str
    label: str
    provenance: Provenance
    base_value: float
    low_value: float
    high_value: float
    savings_low: float | None  # None when the moved input makes the model invalid
    savings_high: float | None

    @property
    def swing(self) -> float:
        if self.savings_low is None or self.savings_high is None:
            return 0.0
        return abs(self.savings_high - self.savings_low)


def _clamp(key: str, value: float) -> float:
    low, high = _BOUNDS.get(key, (0.0, float("inf")))
    return min(max(value, low), high)


def _monthly_savings(inputs: ResolvedInputs, basis: Basis) -> float | None:
    try:
        return compute(inputs).costs(basis).savings_per("month")
    except RoiError:
        return None


def sensitivity(result: RoiResult, basis: Basis, pct: float = 20.0) -> list[SensitivityRow]:
    """One row per input that can change savings, largest swing first (a tornado chart's order)."""
    if not 0 < pct <= 100:
        raise ValueError(f"sensitivity must be in (0, 100] percent, got {pct}")
    share = pct / 100.0
    rows = []
    for item in result.inputs.rows():
        if item.key in _NOT_SAVINGS:
            continue
        low, high = _clamp(item.key, item.value * (1 - share)), _clamp(item.key, item.value * (1 + share))
        rows.append(SensitivityRow(
            key=item.key, label=item.label, provenance=item.provenance, base_value=item.value,
            low_value=low, high_value=high,
            savings_low=_monthly_savings(result.inputs.replace(item.key, low), basis),
            savings_high=_monthly_savings(result.inputs.replace(item.key, high), basis)))
    return sorted(rows, key=lambda row: (-row.swing, row.key))


def no_sensitivity_text(basis: Basis, pct: float) -> str:
    """What to say when no single input moved by ±pct% changes the savings."""
    reason = (" GPUs are reserved whole, so these moves leave the GPU counts unchanged."
              if basis is Basis.ALLOCATION else "")
    return f"No single input moved by ±{pct:g}% changes the monthly savings on the {basis.value} basis.{reason}"


class WaterfallStep(BaseModel):
    """One bar of the monthly savings waterfall: a total, or a change from one cost line."""

    model_config = ConfigDict(frozen=True)

    label: str
    amount_usd: float  # totals are positive; a change is after - before (negative saves money)
    is_total: bool
    start_usd: float  # where the bar starts (for drawing)


def waterfall(result: RoiResult, basis: Basis) -> list[WaterfallStep]:
    """Monthly cost before -> change per line (GPU, tokens, failures) -> monthly cost after."""
    costs = result.costs(basis)
    month = DAYS_PER_MONTH
    steps = [WaterfallStep(label="Cost before", amount_usd=costs.before.total_usd * month, is_total=True, start_usd=0.0)]
    level = costs.before.total_usd * month
    for label, name in (("GPU", "gpu_usd"), ("Tokens", "token_usd"), ("Failures", "failure_usd")):
        change = (getattr(costs.after, name) - getattr(costs.before, name)) * month
        steps.append(WaterfallStep(label=label, amount_usd=change, is_total=False, start_usd=level))
        level += change
    steps.append(WaterfallStep(label="Cost after", amount_usd=costs.after.total_usd * month, is_total=True, start_usd=0.0))
    return steps


class ProjectionPoint(BaseModel):
    """Cumulative cost after some months: without pruning, and with pruning plus its implementation cost."""

    model_config = ConfigDict(frozen=True)

    month: int
    before_usd: float
    after_usd: float


def projection(result: RoiResult, basis: Basis, months: int = 12) -> list[ProjectionPoint]:
    """Cumulative cost month by month; the lines cross at the payback point."""
    if not 1 <= months <= 120:
        raise ValueError(f"projection must cover 1..120 months, got {months}")
    costs = result.costs(basis)
    upfront = result.inputs.implementation_cost_usd.value
    return [ProjectionPoint(month=m, before_usd=costs.before.total_usd * DAYS_PER_MONTH * m,
                            after_usd=upfront + costs.after.total_usd * DAYS_PER_MONTH * m)
            for m in range(months + 1)]
