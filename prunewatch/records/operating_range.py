"""A model's healthy operating range, measured on held-out evaluation prompts, and the alert thresholds it gives.

What a healthy engine looks like depends on the model and the machine: on SmolLM2-135M-Instruct the engine
default skips ~0.13 of the dense work, a 7B model far more; a CPU decodes a token in tens of milliseconds, a
GPU in a few. Thresholds copied from another system page on a healthy engine, so each model's are measured:

- at calibration (`prunewatch run` measures it once per model and caches it beside the calibration), the
  evaluation prompts of the probed domains run dense (sensitivity 0) and at the default sensitivity, every
  served answer scored by the dense reference: the ratio at the default, the reference-scored agreement with
  its 95% interval over prompts and per-prompt spread, the task pass rate dense and pruned, and the time per
  output token (decode) and to first token per prompt token, dense and at the default;
- by `prunewatch tune`, whose sweep also measures where quality falls (the quality-risk lines).

`thresholds()` turns a range into alert thresholds, each with the evidence it came from. The collector
exports them as `prunewatch_alert_threshold{model, kind, source}` (records/metrics.py), the rules compare
with them `on(model)` (prunewatch/alerts/rules.py), and a model without a range falls back to the rule
settings' documented defaults (its alerts say so). Plain data: no torch, no engine.
"""

from __future__ import annotations

import json
import logging
import math
import os
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field, fields
from datetime import datetime
from pathlib import Path
from typing import Any, Literal

from prunewatch.records.intervals import Interval

logger = logging.getLogger("prunewatch.records")

RANGE_FORMAT_VERSION = 1
RANGE_SUFFIX = ".operating-range.json"

Source = Literal["calibration", "tune"]

THRESHOLD_KINDS = ("ratio_low", "ratio_red_line", "ratio_risk", "quality_floor", "tpot_vs_dense_max",
                   "ttft_vs_dense_max")
"""Every kind of `prunewatch_alert_threshold`, in the order the rules use them:
ratio_low (PruningRatioLow), ratio_red_line / ratio_risk (PruningRatioQualityRisk warning / critical),
quality_floor (QualityAgreementLow), tpot_vs_dense_max / ttft_vs_dense_max (the latency-against-dense rules:
largest pruned/dense ratio of time per output token, of time to first token per prompt token)."""


@dataclass(frozen=True)
class Derivation:
    """How thresholds follow from the measured figures: configured factors, written into every range file."""

    ratio_low_share: float = 0.5  # PruningRatioLow: the 24 h ratio fell below half the ratio measured at the default
    red_line_factor: float = 1.5  # without a sweep: a ratio 1.5x the default's is outside the range quality was measured in
    risk_factor: float = 2.0  # ... and 2x the default's is the critical line
    quality_percentile: float = 5.0  # the floor: this percentile of the per-prompt agreement at the default
    latency_tolerance: float = 0.5  # pruned/dense time per token may exceed max(1, measured ratio) by this share
    # (pairs run back to back, but a shared host's load does not slow both kernels alike: on 2 cores at load ~7
    # the sparse decode path measured 1.9x dense where it is faster than dense on a quiet host; 0.5 leaves room
    # for ordinary load, and the rules read the lower bound of the paired ratio's interval on top)

    def __post_init__(self) -> None:
        if not 0.0 < self.ratio_low_share < 1.0:
            raise ValueError(f"ratio_low_share must be within (0, 1), got {self.ratio_low_share}")
        if not 1.0 < self.red_line_factor <= self.risk_factor:
            raise ValueError("need 1 < red_line_factor <= risk_factor")
        if not 0.0 <= self.quality_percentile <= 50.0:
            raise ValueError(f"quality_percentile must be within [0, 50], got {self.quality_percentile}")
        if not 0.0 <= self.latency_tolerance <= 10.0:
            raise ValueError(f"latency_tolerance must be within [0, 10], got {self.latency_tolerance}")


@dataclass(frozen=True)
class Threshold:
    """One alert threshold of one model, with where it came from."""

    model: str
    kind: str
    value: float
    source: Source  # how it was obtained: at calibration (evaluation prompts) or by a `prunewatch tune` sweep
    evidence: str  # the measurement behind it, in words, with its numbers


@dataclass
class PhaseTimes:
    """Median over prompts of one configuration's per-token times (seconds), as the engine measured them."""

    time_per_output_token_s: float | None = None  # decode time / (completion tokens - 1)
    ttft_per_prompt_token_s: float | None = None  # time to first token / prompt tokens


@dataclass
class OperatingRange:
    """What a model did on held-out evaluation prompts, dense and at its default; see the module docstring."""

    model: str  # the name results carry (the `model` label)
    model_fingerprint: str  # weights sha256 prefix: a range is only reused for the same weights
    source: Source
    measured_at: str  # ISO 8601, UTC
    probe_set: str  # which prompts, in words (file, role, domains)
    probe_set_digest: str
    prompts: int  # distinct prompts measured at the default
    sensitivity: float  # "the default": the sensitivity the pruned figures were measured at
    engine: dict[str, Any]  # the pruning settings they were measured with
    device: str  # where the times were measured ("cpu: <name>", "cuda: <name>")
    ratio: float  # mean measured pruning ratio over the prompts at the default
    ratio_max: float  # the largest per-domain mean ratio at the default
    agreement: dict[str, float | int] | None  # Interval.to_dict(): reference-scored agreement at the default
    agreement_per_prompt: list[float] = field(default_factory=list)  # each prompt's agreement at the default
    pass_rate_dense: dict[str, float | int] | None = None  # Interval.to_dict() of the task checks, dense
    pass_rate_default: dict[str, float | int] | None = None  # ... at the default
    dense: PhaseTimes = field(default_factory=PhaseTimes)
    default: PhaseTimes = field(default_factory=PhaseTimes)
    # Measured by a sweep (`prunewatch tune`) only: where quality held and where it fell.
    swept_red_line: float | None = None  # highest mean ratio measured with quality at or above the floor
    swept_risk_ratio: float | None = None  # lowest mean ratio measured with quality below it
    sweep_evidence: dict[str, str] = field(default_factory=dict)
    derivation: Derivation = field(default_factory=Derivation)
    version: int = RANGE_FORMAT_VERSION

    # -- thresholds ---------------------------------------------------------------------------------
    def _where(self) -> str:
        how = "at calibration" if self.source == "calibration" else "by `prunewatch tune`"
        return f"measured {how} on {self.prompts} {self.probe_set}, {self.measured_at[:10]}"

    def thresholds(self) -> list[Threshold]:
        """The alert thresholds this range supports, each with its evidence (a figure it lacks gives none)."""
        d, where = self.derivation, self._where()
        out: list[Threshold] = []

        def add(kind: str, value: float, evidence: str) -> None:
            if math.isfinite(value):
                out.append(Threshold(self.model, kind, round(value, 6), self.source, evidence))

        if self.ratio > 0:
            add("ratio_low", self.ratio * d.ratio_low_share,
                f"{d.ratio_low_share:g} x the mean pruning ratio {self.ratio:.4f} at sensitivity {self.sensitivity:g}, "
                f"{where}")
        red, risk = self._ratio_lines()
        if red is not None:
            add("ratio_red_line", red[0], red[1])
        if risk is not None:
            add("ratio_risk", risk[0], risk[1])
        per_prompt = sorted(self.agreement_per_prompt)
        if per_prompt:
            floor = _percentile(per_prompt, d.quality_percentile)
            interval = Interval.from_dict(self.agreement) if self.agreement else None
            add("quality_floor", floor,
                f"{d.quality_percentile:g}th percentile of the per-prompt reference-scored agreement at sensitivity "
                f"{self.sensitivity:g} (pooled {interval if interval else 'n/a'}), {where}")
        for kind, phase, name in (("tpot_vs_dense_max", "time_per_output_token_s", "time per output token"),
                                  ("ttft_vs_dense_max", "ttft_per_prompt_token_s", "time to first token per prompt token")):
            dense, pruned = getattr(self.dense, phase), getattr(self.default, phase)
            if dense and pruned:
                measured = pruned / dense
                add(kind, max(1.0, measured) * (1.0 + d.latency_tolerance),
                    f"max(1, measured pruned/dense {name} {measured:.3f} ({pruned * 1000:.2f} / {dense * 1000:.2f} ms, "
                    f"medians over prompts on {self.device})) x (1 + tolerance {d.latency_tolerance:g}), {where}")
        return out

    def _ratio_lines(self) -> tuple[tuple[float, str] | None, tuple[float, str] | None]:
        """(red line, risk line), each (value, evidence): from a sweep where one measured them, else derived
        from the ratio measured at the default (quality beyond it was not measured)."""
        d, where, said = self.derivation, self._where(), self.sweep_evidence
        if self.swept_risk_ratio is not None:  # the sweep saw quality fall: both lines measured
            risk = self.swept_risk_ratio
            red = min(self.swept_red_line if self.swept_red_line is not None else risk, risk)
            return ((red, f"{said.get('ratio_red_line', 'highest ratio measured with quality kept')}, {where}"),
                    (risk, f"{said.get('ratio_risk', 'lowest ratio measured with quality lost')}, {where}"))
        if self.swept_red_line is not None:  # quality never fell in the sweep: past its highest ratio is unmeasured
            factor = d.risk_factor / d.red_line_factor
            return ((self.swept_red_line, f"{said.get('ratio_red_line', 'highest ratio measured with quality kept')} "
                                          f"(quality never fell in the sweep), {where}"),
                    (self.swept_red_line * factor, f"{factor:g} x that highest ratio, {where}"))
        if self.ratio_max <= 0:
            return None, None
        base = f"the largest per-domain mean pruning ratio {self.ratio_max:.4f} at sensitivity {self.sensitivity:g}"
        return ((self.ratio_max * d.red_line_factor,
                 f"{d.red_line_factor:g} x {base} (quality past it was not measured), {where}"),
                (self.ratio_max * d.risk_factor, f"{d.risk_factor:g} x {base}, {where}"))

    # -- files ------------------------------------------------------------------------------------
    def to_json(self) -> str:
        data = asdict(self)
        data["thresholds"] = [asdict(t) for t in self.thresholds()]  # for readers; recomputed on load
        return json.dumps(data, indent=2, sort_keys=False) + "\n"

    def save(self, path: Path) -> None:
        """Write atomically (a reader never sees half a file)."""
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(self.to_json())
        os.replace(tmp, path)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> OperatingRange:
        known = {f.name for f in fields(cls)}
        values = {k: v for k, v in data.items() if k in known}
        if values.get("version") != RANGE_FORMAT_VERSION:
            raise ValueError(f"operating range format {values.get('version')!r}, expected {RANGE_FORMAT_VERSION}")
        values["dense"] = PhaseTimes(**(values.get("dense") or {}))
        values["default"] = PhaseTimes(**(values.get("default") or {}))
        values["derivation"] = Derivation(**(values.get("derivation") or {}))
        return cls(**values)

    @classmethod
    def load(cls, path: Path) -> OperatingRange:
        try:
            return cls.from_dict(json.loads(Path(path).read_text()))
        except (OSError, ValueError, TypeError, KeyError) as exc:
            raise ValueError(f"operating range {path} is unreadable: {exc}") from exc


def range_path(directory: Path, model: str, fingerprint: str) -> Path:
    """Where a model's range is cached: beside its calibration, named by model and weights fingerprint."""
    return Path(directory) / f"{model}-{fingerprint[:16]}{RANGE_SUFFIX}"


def load_ranges(directory: Path | None, models: Iterable[str] | None = None) -> dict[str, OperatingRange]:
    """Model name -> its newest readable range in `directory` (only `models` when given). Unreadable files are
    logged and skipped: a broken cache must not stop alerting, whose rules then fall back for that model."""
    if directory is None or not Path(directory).is_dir():
        return {}
    wanted = None if models is None else set(models)
    found: dict[str, OperatingRange] = {}
    for path in sorted(Path(directory).glob(f"*{RANGE_SUFFIX}")):
        try:
            loaded = OperatingRange.load(path)
        except ValueError as exc:
            logger.warning("%s", exc)
            continue
        if wanted is not None and loaded.model not in wanted:
            continue
        current = found.get(loaded.model)
        if current is None or _when(loaded) > _when(current):
            found[loaded.model] = loaded
    return found


def thresholds_of(ranges: Iterable[OperatingRange]) -> list[Threshold]:
    return [t for r in ranges for t in r.thresholds()]


def _when(r: OperatingRange) -> datetime:
    try:
        return datetime.fromisoformat(r.measured_at)
    except ValueError:
        return datetime.min


def _percentile(ordered: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile of sorted values (numpy's default method)."""
    if len(ordered) == 1:
        return float(ordered[0])
    position = (len(ordered) - 1) * q / 100.0
    lower = math.floor(position)
    upper = min(lower + 1, len(ordered) - 1)
    return float(ordered[lower] + (ordered[upper] - ordered[lower]) * (position - lower))


def median(values: Iterable[float | None]) -> float | None:
    present = [v for v in values if v is not None and math.isfinite(v)]
    return statistics.median(present) if present else None
