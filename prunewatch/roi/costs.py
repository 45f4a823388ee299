"""The cost model: before/after cost per day, month and year on two bases, savings and payback.

Pure arithmetic over ResolvedInputs, so the app, the CSV and the CFO report show the same numbers.

- Usage basis: GPU hours billed per day = busy GPU hours / utilisation (capacity follows traffic).
- Allocation basis: whole GPUs reserved 24 hours a day, as many as the busy hours need at the
  utilisation (the honest basis when comparing with an API, because reserved capacity is paid
  whether it computes or not).
Token cost = requests x (input tokens x input price + output tokens x output price).
Failure cost = requests x failed share x cost per failed request.
"""

from __future__ import annotations

import math
from enum import Enum

from pydantic import BaseModel, ConfigDict

from prunewatch.roi.errors import NoTrafficError, RoiError
from prunewatch.roi.inputs import ResolvedInputs, TimeBasis
from prunewatch.roi.load_profile import clients_text
from prunewatch.roi.provenance import Provenance

HOURS_PER_DAY = 24.0
DAYS_PER_MONTH = 365.0 / 12.0  # an average month, so 12 months make exactly one year
DAYS_PER_YEAR = 365.0
PERIOD_DAYS = {"day": 1.0, "month": DAYS_PER_MONTH, "year": DAYS_PER_YEAR}
MILESTONE_DAYS = (30, 60, 90)


class Basis(str, Enum):
    """How GPU cost is counted."""

    ALLOCATION = "allocation"
    USAGE = "usage"

    @property
    def description(self) -> str:
        if self is Basis.ALLOCATION:
            return "whole GPUs reserved 24 h a day, enough for the busy GPU hours at the assumed utilisation"
        return "GPU hours billed = busy GPU hours / utilisation"


class CostLines(BaseModel):
    """Cost per day, by line."""

    model_config = ConfigDict(frozen=True)

    gpu_usd: float
    token_usd: float
    failure_usd: float

    @property
    def total_usd(self) -> float:
        return self.gpu_usd + self.token_usd + self.failure_usd


class BasisCosts(BaseModel):
    """Before and after pruning on one cost basis."""

    model_config = ConfigDict(frozen=True)

    basis: Basis
    before: CostLines
    after: CostLines
    gpu_hours_before: float  # billed (usage) or reserved (allocation) GPU hours per day
    gpu_hours_after: float
    gpus_before: int | None = None  # allocation basis only
    gpus_after: int | None = None

    @property
    def savings_per_day(self) -> float:
        return self.before.total_usd - self.after.total_usd

    def before_per(self, period: str) -> float:
        return self.before.total_usd * PERIOD_DAYS[period]

    def after_per(self, period: str) -> float:
        return self.after.total_usd * PERIOD_DAYS[period]

    def savings_per(self, period: str) -> float:
        return self.savings_per_day * PERIOD_DAYS[period]


class Payback(BaseModel):
    """When cumulative savings repay the implementation cost; `days` is None when they never do."""

    model_config = ConfigDict(frozen=True)

    days: float | None
    reason: str

    @property
    def months(self) -> float | None:
        return None if self.days is None else self.days / DAYS_PER_MONTH


class Milestone(BaseModel):
    """Net position after a number of days: cumulative savings minus the implementation cost."""

    model_config = ConfigDict(frozen=True)

    days: int
    cumulative_savings_usd: float
    net_usd: float
    roi_pct: float | None  # net / implementation cost; None when nothing was invested


class GpuTime(BaseModel):
    """GPU seconds per request before and after pruning, each with its provenance."""

    model_config = ConfigDict(frozen=True)

    before_s: float
    after_s: float
    before_provenance: Provenance
    after_provenance: Provenance
    factor: float
    under_load_label: str | None = None  # what the times are when they come from a load run's throughput

    @property
    def entered(self) -> bool:
        """Whether a time per request was typed in (a production GPU time) rather than read from the store:
        then it is not the store's CPU or GPU time, and no caveat about where the store measured applies."""
        return Provenance.USER_ENTERED in (self.before_provenance, self.after_provenance)

    def label(self, measured_label: str) -> str:
        """What these times are: `measured_label` (the store's, e.g. 'CPU time per request (measured on
        cpu: <name>)') unless one was entered or they come from a load run."""
        if self.entered:
            return "GPU time per request (user-entered)"
        return self.under_load_label or measured_label


class RoiResult(BaseModel):
    """Everything the app and the report show, computed once from ResolvedInputs."""

    model_config = ConfigDict(frozen=True)

    inputs: ResolvedInputs
    gpu_time: GpuTime
    allocation: BasisCosts
    usage: BasisCosts

    def costs(self, basis: Basis) -> BasisCosts:
        return self.allocation if basis is Basis.ALLOCATION else self.usage

    def payback(self, basis: Basis) -> Payback:
        return payback(self.costs(basis).savings_per_day, self.inputs.implementation_cost_usd.value)

    def milestones(self, basis: Basis) -> list[Milestone]:
        return milestones(self.costs(basis).savings_per_day, self.inputs.implementation_cost_usd.value)


def _under_load_time(inputs: ResolvedInputs, factor: float) -> GpuTime:
    """Seconds of a batched server per request: output tokens / aggregate tokens/s at the concurrency.

    The server decodes every concurrent request in the same steps, so a request costs its share of the
    aggregate throughput, not its own streaming time."""
    dense, pruned, load = inputs.dense_tokens_per_s, inputs.pruned_tokens_per_s, inputs.load
    if dense is None or pruned is None or load is None:
        raise RoiError("the under-load basis needs the load run's aggregate throughputs")
    label = (f"{load.profile.time_noun} per request under load ({clients_text(load.concurrency)}, measured on "
             f"{load.profile.machine})")
    if inputs.dense_inference_s is not None:  # an entered production time: the load run gives the ratio only
        before = inputs.dense_inference_s
        return GpuTime(before_s=before.value, after_s=before.value * factor, before_provenance=before.provenance,
                       after_provenance=Provenance.ESTIMATED, factor=factor, under_load_label=label)
    tokens = inputs.completion_tokens_per_request.value
    return GpuTime(before_s=tokens / dense.value, after_s=tokens / pruned.value,
                   before_provenance=Provenance.MEASURED_UNDER_LOAD, after_provenance=Provenance.MEASURED_UNDER_LOAD,
                   factor=factor, under_load_label=label)


def gpu_time(inputs: ResolvedInputs) -> GpuTime:
    """GPU seconds per request before and after, from the basis the inputs carry."""
    factor = inputs.factor
    if not factor > 0:
        raise RoiError(f"GPU time after pruning would be {factor:.3f} x before; check the pruning ratio and the "
                       f"prunable share of inference time")
    if inputs.time_basis is TimeBasis.UNDER_LOAD:
        return _under_load_time(inputs, factor)
    if inputs.dense_inference_s is not None:
        before = inputs.dense_inference_s
        after_provenance = (Provenance.MEASURED if inputs.time_basis is TimeBasis.MEASURED
                            and before.provenance is Provenance.MEASURED else Provenance.ESTIMATED)
        return GpuTime(before_s=before.value, after_s=before.value * factor, before_provenance=before.provenance,
                       after_provenance=after_provenance, factor=factor)
    after = inputs.pruned_inference_s
    if after is None:  # resolve_inputs always sets one of the two
        raise RoiError("neither a dense nor a pruned inference time is available")
    return GpuTime(before_s=after.value / factor, after_s=after.value, before_provenance=Provenance.ESTIMATED,
                   after_provenance=after.provenance, factor=factor)


def _lines(inputs: ResolvedInputs, gpu_usd: float) -> CostLines:
    requests = inputs.requests_per_day.value
    per_request_tokens = (inputs.prompt_tokens_per_request.value * inputs.input_usd_per_mtok.value
                          + inputs.completion_tokens_per_request.value * inputs.output_usd_per_mtok.value) / 1e6
    return CostLines(gpu_usd=gpu_usd, token_usd=requests * per_request_tokens,
                     failure_usd=requests * inputs.failure_rate.value * inputs.incident_cost_usd.value)


def reserved_gpus(busy_hours: float, utilisation: float) -> int:
    """Whole GPUs needed so the busy hours fit in 24 h at the utilisation (at least one for any traffic)."""
    if busy_hours <= 0:
        return 0
    return max(1, math.ceil(round(busy_hours / (HOURS_PER_DAY * utilisation), 9)))


def compute(inputs: ResolvedInputs) -> RoiResult:
    """Cost per day before and after pruning on both bases; raises NoTrafficError at zero volume."""
    requests = inputs.requests_per_day.value
    if requests <= 0:
        raise NoTrafficError("request volume is 0 per day: there is no cost to compare; enter the expected "
                             "requests per day")
    times = gpu_time(inputs)
    price, utilisation = inputs.gpu_hourly_usd.value, inputs.gpu_utilisation.value
    busy_before, busy_after = requests * times.before_s / 3600.0, requests * times.after_s / 3600.0
    usage_before, usage_after = busy_before / utilisation, busy_after / utilisation
    usage = BasisCosts(basis=Basis.USAGE, before=_lines(inputs, usage_before * price),
                       after=_lines(inputs, usage_after * price),
                       gpu_hours_before=usage_before, gpu_hours_after=usage_after)
    gpus_before, gpus_after = reserved_gpus(busy_before, utilisation), reserved_gpus(busy_after, utilisation)
    allocation = BasisCosts(basis=Basis.ALLOCATION,
                            before=_lines(inputs, gpus_before * HOURS_PER_DAY * price),
                            after=_lines(inputs, gpus_after * HOURS_PER_DAY * price),
                            gpu_hours_before=gpus_before * HOURS_PER_DAY, gpu_hours_after=gpus_after * HOURS_PER_DAY,
                            gpus_before=gpus_before, gpus_after=gpus_after)
    return RoiResult(inputs=inputs, gpu_time=times, allocation=allocation, usage=usage)


def payback(savings_per_day: float, implementation_cost_usd: float) -> Payback:
    """Days until savings repay the implementation cost (simple payback, no discounting)."""
    if savings_per_day <= 0:
        return Payback(days=None, reason="no payback: pruning does not save money with these inputs")
    if implementation_cost_usd <= 0:
        return Payback(days=0.0, reason="no implementation cost: savings start on day one")
    days = implementation_cost_usd / savings_per_day
    return Payback(days=days, reason=f"implementation cost / savings per day = {days:.1f} days")


def milestones(savings_per_day: float, implementation_cost_usd: float,
               days: tuple[int, ...] = MILESTONE_DAYS) -> list[Milestone]:
    """Net position at 30, 60 and 90 days, the checkpoints a CFO's ROI table uses."""
    rows = []
    for d in days:
        cumulative = savings_per_day * d
        net = cumulative - implementation_cost_usd
        rows.append(Milestone(days=d, cumulative_savings_usd=cumulative, net_usd=net,
                              roi_pct=net / implementation_cost_usd * 100.0 if implementation_cost_usd > 0 else None))
    return rows
