"""What the store measured over a window, reduced to the figures the cost model needs (pure functions).

Results are split by *configuration*: a run with sensitivity > 0 belongs to the pruned
configuration (including requests that fell back to dense, since production traffic falls back
too); a run with sensitivity 0 is a dense baseline. Dense and pruned inference times are only
compared on probes measured in both configurations, so two different prompt sets never mix.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from datetime import UTC, datetime, timedelta
from statistics import fmean
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from prunewatch.records.models import BUNDLED_PROBE_MODEL
from prunewatch.records.results import ProbeResult

Configuration = Literal["pruned", "dense"]

BUCKET_CHOICES_S = (60, 300, 3_600, 21_600, 86_400)
"""Trend bucket widths (1 min .. 1 day); the narrowest one that keeps a trend under MAX_BUCKETS wins."""
MAX_BUCKETS = 60
PROBE_MODEL_CAVEAT = (f"Measured on the bundled probe model ({BUNDLED_PROBE_MODEL}): these are probe-model numbers "
                      "that show how the figures are obtained, not the savings of a production model. Point the "
                      "collector at your model, or override the GPU time per request with a production figure.")


NOT_RECORDED = "device not recorded"
_TIME_NOUNS = {"cuda": "GPU time", "cpu": "CPU time"}  # device type -> what its measured time is


def device_label(device: str | None, device_name: str | None) -> str:
    """Where one result's timings were measured: 'cpu: <processor>', 'cuda: <GPU>', or not recorded."""
    if not device:
        return NOT_RECORDED
    return f"{device}: {device_name}" if device_name and device_name != device else device


class Window(BaseModel):
    """A half-open time window [start, end) in UTC."""

    model_config = ConfigDict(frozen=True)

    start: datetime
    end: datetime

    @model_validator(mode="after")
    def _ordered(self) -> Window:
        if self.start.tzinfo is None or self.end.tzinfo is None:
            raise ValueError("window bounds must be timezone-aware")
        if self.end <= self.start:
            raise ValueError("window end must be after its start")
        return self

    @classmethod
    def last_days(cls, days: int, now: datetime | None = None) -> Window:
        """The `days` days up to `now` (default: the current time)."""
        if not 1 <= days <= 3_650:
            raise ValueError(f"window must be 1..3650 days, got {days}")
        end = now or datetime.now(UTC)
        return cls(start=end - timedelta(days=days), end=end)

    @property
    def days(self) -> float:
        return (self.end - self.start).total_seconds() / 86_400


class MeasuredSummary(BaseModel):
    """Figures measured by probes in one window for one target (or all): the cost model's evidence."""

    model_config = ConfigDict(frozen=True)

    window: Window
    target: str | None = Field(None, description="Target filter; None means every target in the store.")
    model: str | None = Field(None, description="Model filter; None means every model.")
    targets: list[str] = Field(default_factory=list, description="Targets seen in the window.")
    models: list[str] = Field(default_factory=list, description="Models seen in the window.")
    results_total: int = 0
    results_ok: int = 0
    results_failed: int = 0
    failures_by_reason: dict[str, int] = Field(default_factory=dict)
    pruned_results: int = Field(0, description="Successful results of the pruned configuration (sensitivity > 0).")
    dense_results: int = Field(0, description="Successful dense-baseline results (sensitivity 0).")
    sensitivities: list[float] = Field(default_factory=list, description="Pruned-configuration sensitivities seen.")
    mean_pruning_ratio: float | None = Field(None, description="Mean measured pruning ratio of the pruned configuration.")
    ratio_unit: str | None = None
    pruned_inference_ms: float | None = Field(None, description="Mean inference time per pruned-configuration request.")
    dense_inference_ms: float | None = Field(None, description="Mean inference time per dense-baseline request.")
    matched_probes: int = Field(0, description="Probes (id, version) measured in both configurations.")
    matched_pruned_ms: float | None = Field(None, description="Pruned inference time, mean of per-probe means on matched probes.")
    matched_dense_ms: float | None = Field(None, description="Dense inference time, mean of per-probe means on matched probes.")
    prompt_tokens: float | None = Field(None, description="Mean prompt tokens per pruned-configuration request.")
    completion_tokens: float | None = Field(None, description="Mean completion tokens per pruned-configuration request.")
    tokens_per_s: float | None = None
    continuation_agreement_mean: float | None = None
    continuation_agreement_min: float | None = None
    perplexity_delta_pct_mean: float | None = None
    first_result_at: datetime | None = None
    last_result_at: datetime | None = None
    timing_devices: dict[str, int] = Field(
        default_factory=dict, description="Where the inference times above were measured ('cpu: <name>', "
                                           "'cuda: <name>', or 'device not recorded') -> successful results.")

    @property
    def time_noun(self) -> str:
        """'GPU time' only when every time was measured on a GPU, 'CPU time' when all on a CPU, else 'Time'."""
        kinds = {label.split(":", 1)[0] for label in self.timing_devices}
        return _TIME_NOUNS.get(kinds.pop(), "Time") if len(kinds) == 1 else "Time"

    @property
    def measured_on(self) -> str:
        """'measured on cpu: <name>' (several joined with 'and'), or 'device not recorded'."""
        where = [label for label in self.timing_devices if label != NOT_RECORDED]
        if not where:
            return NOT_RECORDED
        text = "measured on " + " and ".join(where)
        return text + (f", {NOT_RECORDED} for {self.timing_devices[NOT_RECORDED]} result(s)"
                       if NOT_RECORDED in self.timing_devices else "")

    @property
    def time_label(self) -> str:
        """What a measured time per request is, e.g. 'CPU time per request (measured on cpu: <name>)'.

        Why: the cost model prices time per request at a GPU price; time measured on a CPU (the bundled
        probe model, a laptop) must never be shown as GPU time.
        """
        return f"{self.time_noun} per request ({self.measured_on})"

    @property
    def measured_on_gpu(self) -> bool:
        return self.time_noun == "GPU time"

    @property
    def failure_rate(self) -> float | None:
        """Failed share of every probe request in the window; None when nothing ran."""
        return self.results_failed / self.results_total if self.results_total else None

    @property
    def uses_probe_model(self) -> bool:
        """True when the chosen measurements come from the bundled probe model."""
        return (self.model or "") == BUNDLED_PROBE_MODEL or (self.model is None and BUNDLED_PROBE_MODEL in self.models)

    @property
    def has_dense_baseline(self) -> bool:
        return self.matched_probes > 0 and bool(self.matched_dense_ms) and self.matched_pruned_ms is not None


def configuration(result: ProbeResult) -> Configuration | None:
    """Pruned or dense configuration of a successful result; None when it cannot be told (or it failed)."""
    if not result.ok:
        return None
    if result.baseline:  # a dense run the collector made on purpose on the same target
        return "dense"
    if result.sensitivity is not None:
        return "pruned" if result.sensitivity > 0 else "dense"
    if result.pruning_ratio is not None:  # a target that reports a ratio but no sensitivity
        return "pruned" if result.pruning_ratio > 0 else "dense"
    return None


def _mean(values: Iterable[float | int | None]) -> float | None:
    present = [float(v) for v in values if v is not None]
    return fmean(present) if present else None


def _per_probe_ms(results: Sequence[ProbeResult]) -> dict[tuple[str, int], float]:
    grouped: dict[tuple[str, int], list[float]] = defaultdict(list)
    for r in results:
        if r.inference_ms is not None:
            grouped[(r.probe_id, r.probe_version)].append(r.inference_ms)
    return {key: fmean(values) for key, values in grouped.items()}


def select(results: Iterable[ProbeResult], window: Window, target: str | None = None,
           model: str | None = None) -> list[ProbeResult]:
    """The results inside the window for the target/model filters (None keeps all)."""
    return [r for r in results if window.start <= r.created_at < window.end
            and (target is None or r.target == target) and (model is None or r.model == model)]


def summarize(results: Iterable[ProbeResult], window: Window, target: str | None = None,
              model: str | None = None) -> MeasuredSummary:
    """Reduce probe results to a MeasuredSummary; an empty window gives a summary of zeros and Nones."""
    everything = [r for r in results if window.start <= r.created_at < window.end]
    chosen = select(everything, window, target, model)
    pruned = [r for r in chosen if configuration(r) == "pruned"]
    dense = [r for r in chosen if configuration(r) == "dense"]
    failed = [r for r in chosen if not r.ok]
    pruned_by_probe, dense_by_probe = _per_probe_ms(pruned), _per_probe_ms(dense)
    matched = sorted(set(pruned_by_probe) & set(dense_by_probe))
    units = Counter(r.ratio_unit for r in pruned if r.ratio_unit)
    agreement = [r.continuation_agreement for r in pruned if r.continuation_agreement is not None]
    return MeasuredSummary(
        window=window, target=target, model=model,
        targets=sorted({r.target for r in everything}),
        models=sorted({r.model for r in everything if target is None or r.target == target}),
        results_total=len(chosen), results_ok=len(chosen) - len(failed), results_failed=len(failed),
        failures_by_reason=dict(sorted(Counter(r.failure_reason or "unknown" for r in failed).items())),
        pruned_results=len(pruned), dense_results=len(dense),
        sensitivities=sorted({r.sensitivity for r in pruned if r.sensitivity is not None}),
        mean_pruning_ratio=_mean(r.pruning_ratio for r in pruned),
        ratio_unit=units.most_common(1)[0][0] if units else None,
        pruned_inference_ms=_mean(r.inference_ms for r in pruned),
        dense_inference_ms=_mean(r.inference_ms for r in dense),
        matched_probes=len(matched),
        matched_pruned_ms=fmean(pruned_by_probe[k] for k in matched) if matched else None,
        matched_dense_ms=fmean(dense_by_probe[k] for k in matched) if matched else None,
        prompt_tokens=_mean(r.prompt_tokens for r in pruned),
        completion_tokens=_mean(r.completion_tokens for r in pruned),
        tokens_per_s=_mean(r.tokens_per_s for r in pruned),
        continuation_agreement_mean=fmean(agreement) if agreement else None,
        continuation_agreement_min=min(agreement) if agreement else None,
        perplexity_delta_pct_mean=_mean(r.perplexity_delta_pct for r in pruned),
        first_result_at=min((r.created_at for r in chosen), default=None),
        last_result_at=max((r.created_at for r in chosen), default=None),
        timing_devices=dict(sorted(Counter(device_label(r.device, r.device_name) for r in (*pruned, *dense)
                                           if r.inference_ms is not None).items())),
    )


class TrendPoint(BaseModel):
    """Measured figures of one time bucket (for trend charts)."""

    model_config = ConfigDict(frozen=True)

    start: datetime
    results: int
    failed: int
    mean_pruning_ratio: float | None
    pruned_inference_ms: float | None
    dense_inference_ms: float | None
    continuation_agreement: float | None


def choose_bucket_s(first: datetime, last: datetime) -> int:
    """The narrowest bucket width that keeps the data's span under MAX_BUCKETS buckets."""
    span = (last - first).total_seconds()
    for width in BUCKET_CHOICES_S:
        if span / width < MAX_BUCKETS:
            return width
    return BUCKET_CHOICES_S[-1] * max(1, int(span // (BUCKET_CHOICES_S[-1] * MAX_BUCKETS)) + 1)


def trend(results: Sequence[ProbeResult], bucket_s: int | None = None) -> tuple[int, list[TrendPoint]]:
    """Per-bucket measured figures, oldest first, and the bucket width used (seconds)."""
    if not results:
        return bucket_s or BUCKET_CHOICES_S[0], []
    first = min(r.created_at for r in results)
    width = bucket_s or choose_bucket_s(first, max(r.created_at for r in results))
    epoch = datetime(1970, 1, 1, tzinfo=UTC)
    buckets: dict[datetime, list[ProbeResult]] = defaultdict(list)
    for r in results:
        seconds = (r.created_at - epoch).total_seconds()
        buckets[epoch + timedelta(seconds=seconds - seconds % width)].append(r)
    points = []
    for start in sorted(buckets):
        group = buckets[start]
        pruned = [r for r in group if configuration(r) == "pruned"]
        dense = [r for r in group if configuration(r) == "dense"]
        points.append(TrendPoint(
            start=start, results=len(group), failed=sum(1 for r in group if not r.ok),
            mean_pruning_ratio=_mean(r.pruning_ratio for r in pruned),
            pruned_inference_ms=_mean(r.inference_ms for r in pruned),
            dense_inference_ms=_mean(r.inference_ms for r in dense),
            continuation_agreement=_mean(r.continuation_agreement for r in pruned),
        ))
    return width, points


class ScatterPoint(BaseModel):
    """One successful probe: its pruning ratio against its inference time."""

    model_config = ConfigDict(frozen=True)

    created_at: datetime
    probe_id: str
    domain: str
    configuration: Configuration
    pruning_ratio: float
    inference_ms: float


def scatter_points(results: Iterable[ProbeResult]) -> list[ScatterPoint]:
    """Ratio vs latency for every successful result that measured both."""
    points = []
    for r in results:
        config = configuration(r)
        if config is not None and r.pruning_ratio is not None and r.inference_ms is not None:
            points.append(ScatterPoint(created_at=r.created_at, probe_id=r.probe_id, domain=r.domain,
                                       configuration=config, pruning_ratio=r.pruning_ratio,
                                       inference_ms=r.inference_ms))
    return points
