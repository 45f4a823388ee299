"""`prunewatch tune`: sweep sensitivity over the probes, find the knee, recommend knee - margin.

Method (every figure measured on the target, nothing modelled):

1. After one discarded warm-up probe, for each sensitivity on the grid (it must include 0.0, the
   dense baseline, and 1.0) run every probe: mean pruning ratio (measured by the engine), median
   latency per generated token and mean quality. Latency is the engine's inference time when
   the target reports it, else the probe duration the collector measured. With `repeats` > 1
   the grid is swept that many times in alternating directions (so drift in the machine's speed
   does not tilt the curve) and each point keeps the median latency of its passes. Quality is the
   reference-scored agreement of the served answer when a dense reference scored it (`--model` uses the
   engine itself run dense; a target uses the reference the targets file names), else the engine's
   teacher-forced continuation agreement when the target reports it, else the word-level agreement of the
   output with the target's own output at sensitivity 0 (greedy decoding makes that the dense answer).
2. Quality knee: where quality starts to fall. On quality normalised to [0, 1] over the sweep,
   the point farthest above the straight line from (0, best) to (1, worst) (the Kneedle rule).
   If quality falls by less than `min_quality_drop` over the whole sweep, it has no knee.
3. Latency knee: where latency gains flatten, by the same rule on the gain 1 - latency/latency(0).
   If the gain never exceeds `min_latency_gain`, or rises evenly (no point stands out by
   `min_knee_distance`), it has no knee.
4. Knee = the lower of the two knees (past the quality knee quality falls; past the latency knee
   more pruning buys little); 1.0 when neither exists. Recommendation = knee - margin, >= 0.
5. Optionally, a layer blacklist: at the recommendation, for each layer the engine bypassed,
   run the probes again with that layer protected; a layer whose protection raises quality by
   at least `min_blacklist_gain` is recommended for the blacklist.
6. Alert thresholds for this model (`AlertThresholds`), from the same sweep points: the critical
   quality-risk ratio is the lowest mean ratio measured with quality below `quality_floor`; the
   warning red line the highest ratio measured with quality at or above it (below the critical
   one); the 24 h ratio floor of PruningRatioLow is `ratio_floor_share` of the ratio at the
   recommended sensitivity (interpolated between sweep points). A figure the sweep cannot support
   (quality never fell, nothing was pruned) is left out.
7. The model's operating range (records/operating_range.py) from the same sweep: its dense and default
   points' results (ratio, reference-scored agreement and its spread, pass rates, per-token times), with
   the red and risk lines of step 6 as measured lines. `tune-<target>-range.json` holds it; with `--model`
   it also replaces the cached range the main job and `alerts eval` read, so the rules compare with it.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import NamedTuple

from prunewatch.collector.operating_range import engine_configuration, summarise
from prunewatch.collector.probe_round import run_round
from prunewatch.collector.reference import Reference
from prunewatch.collector.targets import TunableTarget
from prunewatch.probes import ProbeSet
from prunewatch.records.operating_range import OperatingRange
from prunewatch.records.results import ProbeResult

DEFAULT_GRID = tuple(round(i / 10, 1) for i in range(11))


class TuneError(ValueError):
    """The sweep cannot run or cannot be interpreted (bad grid, a baseline target, every probe failed)."""


@dataclass(frozen=True)
class TuneSettings:
    sensitivities: tuple[float, ...] = DEFAULT_GRID
    margin: float = 0.07  # safety margin below the knee
    min_quality_drop: float = 0.01  # a smaller fall over the whole sweep is noise: no quality knee
    min_latency_gain: float = 0.02  # likewise for latency gains
    min_knee_distance: float = 0.05  # a knee must stand this far (normalised) from the straight line
    probe_timeout_s: float = 300.0
    repeats: int = 1  # passes over the grid, alternating direction; per point the median of the passes
    warmup: bool = True  # one discarded probe first, so the first point does not pay for cold caches
    blacklist: bool = False
    min_blacklist_gain: float = 0.02
    quality_floor: float = 0.95  # quality below it is lost quality (the governor's default floor)
    ratio_floor_share: float = 0.5  # PruningRatioLow: a 24 h ratio below this share of the recommended one
    configured_red_line: float | None = None  # the rules' red line when the sweep measures none (ratio_low < it)

    def __post_init__(self) -> None:
        grid = self.sensitivities
        if len(grid) < 3 or list(grid) != sorted(set(grid)):
            raise TuneError("sensitivities must be at least 3 distinct values in increasing order")
        if grid[0] != 0.0 or grid[-1] != 1.0:
            raise TuneError("sensitivities must include the baselines 0.0 (dense) and 1.0")
        if not 0.0 <= self.margin < 1.0:
            raise TuneError(f"margin must be within [0, 1), got {self.margin}")
        if not 1 <= self.repeats <= 20:
            raise TuneError(f"repeats must be within 1..20, got {self.repeats}")
        if not 0.0 < self.quality_floor <= 1.0:
            raise TuneError(f"quality_floor must be within (0, 1], got {self.quality_floor}")
        if not 0.0 < self.ratio_floor_share < 1.0:
            raise TuneError(f"ratio_floor_share must be within (0, 1), got {self.ratio_floor_share}")


@dataclass
class SweepPoint:
    sensitivity: float
    probes: int
    failed: int
    pruning_ratio: float | None  # mean over ok probes, measured by the engine
    latency_ms: float | None  # median per generated token over the ok probes
    quality: float | None
    layers_bypassed: dict[int, int] = field(default_factory=dict)  # layer -> probes that bypassed it


@dataclass
class BlacklistTrial:
    layer: int
    quality: float | None
    pruning_ratio: float | None
    quality_gain: float | None


@dataclass
class AlertThresholds:
    """Alert thresholds for the tuned model, each with the sweep evidence it came from (None: not supported)."""

    quality_floor: float
    ratio_low: float | None = None
    quality_red_line: float | None = None
    quality_risk_ratio: float | None = None
    evidence: dict[str, str] = field(default_factory=dict)


@dataclass
class TuneReport:
    target: str
    model: str
    measured_at: str
    probes: int
    probe_set_digest: str
    latency_source: str
    quality_source: str
    points: list[SweepPoint]
    quality_knee: float | None
    latency_knee: float | None
    knee: float
    margin: float
    recommended_sensitivity: float
    blacklist_trials: list[BlacklistTrial] = field(default_factory=list)
    recommended_blacklist: list[int] = field(default_factory=list)
    alert_thresholds: AlertThresholds | None = None
    operating_range: OperatingRange | None = None
    method: str = ("Kneedle on measured sweep points: quality knee (quality starts to fall) and latency knee "
                   "(gains flatten); knee = the lower; recommended = knee - margin")

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2) + "\n"


Pass = tuple[list[ProbeResult], list[float | None]]
"""One pass at one sensitivity: its results, and each one's quality (None: failed or not scored)."""


def _mean(values: Sequence[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return sum(present) / len(present) if present else None


def word_agreement(text: str, reference: str) -> float:
    """Share of the reference's words matched position by position (1.0 for two empty texts)."""
    ref, got = reference.split(), text.split()
    if not ref:
        return 1.0 if not got else 0.0
    return sum(a == b for a, b in zip(got, ref)) / len(ref)


def kneedle(xs: Sequence[float], ys: Sequence[float], *, decreasing: bool, min_distance: float) -> float | None:
    """x of the point farthest from the chord of the normalised curve, or None when none stands out.

    decreasing=True: a curve that stays high, then falls (quality); the knee is where it starts to fall.
    decreasing=False: a curve that rises, then flattens (latency gain); the knee is where it flattens.
    """
    lo, hi = min(ys), max(ys)
    x0, x1 = xs[0], xs[-1]
    if hi - lo <= 0 or x1 <= x0:
        return None
    best_x, best_d = None, min_distance
    for x, y in zip(xs, ys):
        xn, yn = (x - x0) / (x1 - x0), (y - lo) / (hi - lo)
        distance = yn - (1.0 - xn) if decreasing else yn - xn
        if distance > best_d + 1e-12:
            best_x, best_d = x, distance
    return best_x


def _summarise(sensitivity: float, results: list[ProbeResult], quality: list[float | None],
               engine_latency: bool = True) -> SweepPoint:
    ok = [r for r in results if r.ok]
    bypassed: dict[int, int] = {}
    for r in ok:
        for layer in r.layers_bypassed or []:
            bypassed[layer] = bypassed.get(layer, 0) + 1
    # Per generated token, so a pruned answer that stops early does not look faster than it is;
    # the median, so one probe slowed by a noisy neighbour does not move the point.
    per_token = ((r.inference_ms if engine_latency else r.duration_ms, r.completion_tokens) for r in ok)
    latency = [ms / tokens for ms, tokens in per_token if tokens and ms is not None]
    return SweepPoint(sensitivity=sensitivity, probes=len(results), failed=len(results) - len(ok),
                      pruning_ratio=_mean([r.pruning_ratio for r in ok]),
                      latency_ms=statistics.median(latency) if latency else None,
                      quality=_mean(quality), layers_bypassed=dict(sorted(bypassed.items())))


def _merge(sensitivity: float, runs: list[Pass], engine_latency: bool) -> SweepPoint:
    """One point from its passes: ratio and quality over all results, latency the median of the passes."""
    results = [r for rs, _ in runs for r in rs]
    quality = [q for _, qs in runs for q in qs]
    point = _summarise(sensitivity, results, quality, engine_latency)
    latencies = [_summarise(sensitivity, rs, qs, engine_latency).latency_ms for rs, qs in runs]
    present = [v for v in latencies if v is not None]
    point.latency_ms = statistics.median(present) if present else None
    return point


class Sweeper:
    """Runs the probes against one target at given sensitivities / blacklists and scores them."""

    def __init__(self, target: TunableTarget, probe_set: ProbeSet, settings: TuneSettings,
                 progress: Callable[[str], None] | None = None, reference: Reference | None = None) -> None:
        if not hasattr(target, "with_overrides"):
            raise TuneError(f"target {target.name} cannot change its sensitivity per request")
        if getattr(target, "kind", "prunewatch") == "openai":
            raise TuneError(f"target {target.name} is a baseline (openai): it does not prune, there is nothing to tune")
        self.target = target
        self.probe_set = probe_set
        self.settings = settings
        self.progress = progress or (lambda _message: None)
        self.reference = reference
        self.dense_text: dict[str, str] = {}
        self.quality_kinds: set[str] = set()  # reference, continuation, words: what scored the answers
        self.engine_latency = True
        self.raw: dict[float, list[ProbeResult]] = {}  # every result per sensitivity (blacklist trials left out)

    def run(self, sensitivity: float, blacklist: Sequence[int] | None = None) -> Pass:
        target = self.target.with_overrides(sensitivity=sensitivity, layer_blacklist=list(blacklist or []))
        summary = run_round(target, self.probe_set, [], timeout_s=self.settings.probe_timeout_s,
                            reference=self.reference)
        results = summary.results
        if not blacklist:
            self.raw.setdefault(sensitivity, []).extend(results)
        if sensitivity == 0.0 and not blacklist:
            self.dense_text = {r.probe_id: r.output_text or "" for r in results if r.ok}
        quality: list[float | None] = []
        for r in results:
            if not r.ok:
                quality.append(None)
            elif r.reference_agreement is not None:
                self.quality_kinds.add("reference")
                quality.append(r.reference_agreement)
            elif r.continuation_agreement is not None:
                self.quality_kinds.add("continuation")
                quality.append(r.continuation_agreement)
            else:
                self.quality_kinds.add("words")
                reference = self.dense_text.get(r.probe_id)
                quality.append(None if reference is None else word_agreement(r.output_text or "", reference))
        return results, quality


QUALITY_SOURCES = {
    "reference": "reference-scored agreement of the served answer with a dense reference (measured)",
    "continuation": "token agreement with the dense model, teacher-forced on its continuation (engine, measured)",
    "words": "word agreement with the target's own output at sensitivity 0 (collector, measured)",
}


def tune(target: TunableTarget, probe_set: ProbeSet, settings: TuneSettings = TuneSettings(),
         progress: Callable[[str], None] | None = None, reference: Reference | None = None,
         default_sensitivity: float = 0.5) -> TuneReport:
    """Sweep, find the knees, recommend; optionally discover a layer blacklist. With a `reference`, quality is
    the reference-scored agreement of each served answer; the report's operating range is read at the grid point
    nearest `default_sensitivity`."""
    sweeper = Sweeper(target, probe_set, settings, progress, reference)
    if settings.warmup:
        sweeper.progress("warm-up: one probe, not measured")
        run_round(target.with_overrides(sensitivity=0.0), ProbeSet(probe_set.probes[:1], probe_set.source), [],
                  timeout_s=settings.probe_timeout_s)
    passes: dict[float, list[Pass]] = {s: [] for s in settings.sensitivities}
    for repeat in range(settings.repeats):
        # Reversed on odd passes; the dense answers that word agreement compares with exist from pass 1 on.
        grid = settings.sensitivities if repeat % 2 == 0 else tuple(reversed(settings.sensitivities))
        for sensitivity in grid:
            sweeper.progress(f"pass {repeat + 1}/{settings.repeats}, sensitivity {sensitivity:.2f}: "
                             f"{len(probe_set.probes)} probes")
            passes[sensitivity].append(sweeper.run(sensitivity))
    # One latency definition for the whole sweep: the engine's inference time if every answer had it.
    engine_latency = all(r.inference_ms is not None for runs in passes.values() for results, _ in runs
                         for r in results if r.ok)
    sweeper.engine_latency = engine_latency
    points = [_merge(s, runs, engine_latency) for s, runs in passes.items()]
    usable = [p for p in points if p.quality is not None and p.latency_ms is not None]
    if len(usable) != len(points) or points[0].latency_ms in (None, 0):
        failed = [p.sensitivity for p in points if p not in usable]
        raise TuneError(f"every probe failed at sensitivity {failed}; run `prunewatch doctor --target {target.name}`")
    xs = [p.sensitivity for p in points]
    qualities = [p.quality for p in usable if p.quality is not None]  # usable is every point here
    latencies = [p.latency_ms for p in usable if p.latency_ms is not None]
    gains = [1.0 - ms / latencies[0] for ms in latencies]
    quality_knee = None
    if max(qualities) - min(qualities) >= settings.min_quality_drop:
        quality_knee = kneedle(xs, qualities, decreasing=True, min_distance=settings.min_knee_distance)
    latency_knee = None
    if max(gains) >= settings.min_latency_gain:
        latency_knee = kneedle(xs, gains, decreasing=False, min_distance=settings.min_knee_distance)
    knees = [k for k in (quality_knee, latency_knee) if k is not None]
    knee = min(knees) if knees else 1.0
    recommended = round(max(0.0, knee - settings.margin), 4)
    report = TuneReport(
        target=target.name, model=target.model, measured_at=datetime.now(UTC).isoformat(timespec="seconds"),
        probes=len(probe_set.probes), probe_set_digest=probe_set.digest,
        latency_source=("engine inference time per token (measured)" if engine_latency
                        else "probe duration per token (collector, measured)"),
        quality_source="; ".join(QUALITY_SOURCES[k] for k in ("reference", "continuation", "words")
                                 if k in sweeper.quality_kinds) or QUALITY_SOURCES["words"],
        points=points, quality_knee=quality_knee, latency_knee=latency_knee, knee=knee, margin=settings.margin,
        recommended_sensitivity=recommended)
    report.alert_thresholds = alert_thresholds(points, recommended, settings)
    report.operating_range = _operating_range(target, sweeper, report, probe_set, default_sensitivity)
    if settings.blacklist:
        _discover_blacklist(sweeper, report)
    return report


def _ratio_at(points: Sequence[SweepPoint], sensitivity: float) -> float | None:
    """The mean measured ratio at `sensitivity`, linear between the two sweep points around it."""
    known = [(p.sensitivity, p.pruning_ratio) for p in points if p.pruning_ratio is not None]
    for (x0, y0), (x1, y1) in zip(known, known[1:]):
        if x0 <= sensitivity <= x1:
            return y0 if x1 == x0 else y0 + (y1 - y0) * (sensitivity - x0) / (x1 - x0)
    return None


class _Measured(NamedTuple):
    """A sweep point that measured both its ratio and its quality."""

    sensitivity: float
    pruning_ratio: float
    quality: float


def alert_thresholds(points: Sequence[SweepPoint], recommended: float, settings: TuneSettings) -> AlertThresholds:
    """Thresholds of the ratio alerts for this model from its measured sweep (method: module docstring, 6)."""
    floor = settings.quality_floor
    out = AlertThresholds(quality_floor=floor)
    measured = [_Measured(p.sensitivity, p.pruning_ratio, p.quality) for p in points
                if p.pruning_ratio is not None and p.quality is not None]
    lost = [p for p in measured if p.quality < floor and p.pruning_ratio > 0]
    if lost:
        risk = min(lost, key=lambda p: p.pruning_ratio)
        out.quality_risk_ratio = round(risk.pruning_ratio, 4)
        out.evidence["quality_risk_ratio"] = (f"lowest mean ratio measured with quality below {floor:g}: "
                                              f"{risk.pruning_ratio:.4f} at sensitivity {risk.sensitivity:g} "
                                              f"(quality {risk.quality:.3f})")
        kept = [p for p in measured if p.quality >= floor and 0 < p.pruning_ratio < risk.pruning_ratio]
        if kept:
            line = max(kept, key=lambda p: p.pruning_ratio)
            out.quality_red_line = round(line.pruning_ratio, 4)
            out.evidence["quality_red_line"] = (f"highest mean ratio measured with quality at or above {floor:g}: "
                                                f"{line.pruning_ratio:.4f} at sensitivity {line.sensitivity:g} "
                                                f"(quality {line.quality:.3f})")
        else:  # the rules need red line <= risk line; nothing below the risk line kept quality
            out.quality_red_line = out.quality_risk_ratio
            out.evidence["quality_red_line"] = "no smaller measured ratio kept the quality: the risk line itself"
    else:
        out.evidence["quality_risk_ratio"] = f"quality never fell below {floor:g} in the sweep: no risk line measured"
    at_recommended = _ratio_at(points, recommended)
    if at_recommended is not None and at_recommended > 0:
        low = round(at_recommended * settings.ratio_floor_share, 4)
        red_line = out.quality_red_line if out.quality_red_line is not None else settings.configured_red_line
        if red_line is None or low < red_line:
            out.ratio_low = low
            out.evidence["ratio_low"] = (f"{settings.ratio_floor_share:g} x the ratio at the recommended sensitivity "
                                         f"{recommended:g} ({at_recommended:.4f}, interpolated between sweep points)")
    if "ratio_low" not in out.evidence and out.quality_red_line is not None:
        out.ratio_low = round(out.quality_red_line * settings.ratio_floor_share, 4)  # the rules need low < red line
        out.evidence["ratio_low"] = (f"no pruning measured at the recommended sensitivity {recommended:g}: "
                                     f"{settings.ratio_floor_share:g} x the measured red line, so the rules stay "
                                     "ordered")
    if "ratio_low" not in out.evidence:
        out.evidence["ratio_low"] = "no pruning at the recommended sensitivity: no ratio floor measured"
    return out


def _operating_range(target: TunableTarget, sweeper: Sweeper, report: TuneReport, probe_set: ProbeSet,
                     default_sensitivity: float) -> OperatingRange | None:
    """The range of the sweep's dense and default points, with the sweep's red and risk lines as measured ones."""
    grid = sorted(s for s in sweeper.raw if s > 0)
    if not grid or 0.0 not in sweeper.raw:
        return None
    default = min(grid, key=lambda s: abs(s - default_sensitivity))
    engine = getattr(target, "engine", None)
    results = sweeper.raw[default]
    device = next((f"{r.device}: {r.device_name}" for r in results if r.device and r.device_name), "not recorded")
    try:
        measured = summarise(
            sweeper.raw[0.0], results, model=target.model,
            fingerprint=engine.loaded.fingerprint if engine is not None else f"target-{target.name}",
            source="tune", probe_set=probe_set, sensitivity=default,
            engine=(engine_configuration(engine.settings) if engine is not None else {"target": target.name}),
            device=device, measured_at=report.measured_at)
    except ValueError:
        return None
    thresholds = report.alert_thresholds
    if thresholds is not None:
        measured.swept_red_line = thresholds.quality_red_line
        measured.swept_risk_ratio = thresholds.quality_risk_ratio
        floor = f"quality floor {thresholds.quality_floor:g}, {report.quality_source}"
        for kind, name in (("ratio_red_line", "quality_red_line"), ("ratio_risk", "quality_risk_ratio")):
            if name in thresholds.evidence:
                measured.sweep_evidence[kind] = f"{thresholds.evidence[name]} ({floor})"
    return measured


def write_operating_range(report: TuneReport, out_dir: Path) -> Path | None:
    """`tune-<target>-range.json`: the model's operating range and the alert thresholds it gives."""
    if report.operating_range is None:
        return None
    path = out_dir / f"tune-{report.target}-range.json"
    report.operating_range.save(path)
    return path


def _discover_blacklist(sweeper: Sweeper, report: TuneReport) -> None:
    """Per-layer A/B at the recommendation: protect one bypassed layer at a time, compare quality."""
    sensitivity = report.recommended_sensitivity
    sweeper.progress(f"blacklist: reference at sensitivity {sensitivity:.2f}")
    results, quality = sweeper.run(sensitivity)
    reference = _summarise(sensitivity, results, quality, sweeper.engine_latency)
    for layer in sorted(reference.layers_bypassed):
        sweeper.progress(f"blacklist: layer {layer} protected")
        results, quality = sweeper.run(sensitivity, [layer])
        trial = _summarise(sensitivity, results, quality, sweeper.engine_latency)
        gain = None if trial.quality is None or reference.quality is None else trial.quality - reference.quality
        report.blacklist_trials.append(BlacklistTrial(layer=layer, quality=trial.quality,
                                                      pruning_ratio=trial.pruning_ratio, quality_gain=gain))
        if gain is not None and gain >= sweeper.settings.min_blacklist_gain:
            report.recommended_blacklist.append(layer)


def write_report(report: TuneReport, out_dir: Path) -> tuple[Path, Path]:
    """`tune-<target>.json` and `tune-<target>.png` in out_dir."""
    from prunewatch.collector.tune_plot import plot_sweep

    out_dir.mkdir(parents=True, exist_ok=True)
    json_path = out_dir / f"tune-{report.target}.json"
    png_path = out_dir / f"tune-{report.target}.png"
    json_path.write_text(report.to_json())
    plot_sweep(report, png_path)
    return json_path, png_path
