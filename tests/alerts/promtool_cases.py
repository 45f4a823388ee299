"""Read prunewatch/alerts/rules_test.yml and turn a test's input series into the probe results that would produce them.

The conversion is the inverse of CollectorMetrics.record: a gauge sample is one successful result
carrying that value; a counter's increase between two samples is that many results; a histogram's
per-bucket increase is that many results with a latency inside the bucket. Inputs that no stored
result could produce (a metric the store does not hold, a counter starting above zero, a declared
result count smaller than the samples needing results) raise `NotConvertible`, so the comparison
never runs on a silently different history.
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import yaml

from prunewatch.alerts._series import GOVERNOR_CLAMPS_TOTAL, GaugeSeries
from prunewatch.alerts.durations import parse_duration
from prunewatch.records.metrics import LATENCY_BUCKETS
from prunewatch.records.results import ProbeResult
from prunewatch.records.store.governor import GovernorDecision

EPOCH = datetime(1970, 1, 1, tzinfo=UTC)  # promtool evaluates from Unix time 0
PROMPT_TOKENS = 100  # the prompt length of a converted result: a time to first token per prompt token needs one
GAUGE_FIELDS = {"prunewatch_pruning_ratio": "pruning_ratio", "prunewatch_continuation_agreement": "continuation_agreement",
                "prunewatch_reference_agreement": "reference_agreement",
                "prunewatch_time_per_output_token_seconds": "decode_tokens_per_s",
                "prunewatch_time_to_first_token_per_prompt_token_seconds": "ttft_ms"}
DENSE_FIELDS = {"prunewatch_dense_time_per_output_token_seconds": "decode_tokens_per_s",
                "prunewatch_dense_time_to_first_token_per_prompt_token_seconds": "ttft_ms"}
"""Gauges of pruned results and of dense baseline results: one result per probe and instant carries each."""
SERIES_GIVEN = frozenset({"prunewatch_alert_threshold", "prunewatch_reference_agreement_window",
                          "prunewatch_reference_agreement_prompts", "prunewatch_task_pass_rate_window",
                          "prunewatch_latency_vs_dense_window", "prunewatch_latency_vs_dense_pairs"})
"""Gauges the store does not derive from one result each: the measured thresholds (constant series read from a
model's operating range) and the quality and latency windows (derived from many results; their replay from stored results is
tested against the collector's own in test_alert_series.py). They reach the evaluator as series."""


def field_value(metric: str, value: float) -> float:
    """The ProbeResult field value that makes `metric` show `value`."""
    name = GAUGE_FIELDS.get(metric) or DENSE_FIELDS[metric]
    if name == "decode_tokens_per_s":
        return 1.0 / value
    if name == "ttft_ms":
        return value * PROMPT_TOKENS * 1000.0
    return value
BUCKET_METRIC = "prunewatch_inference_latency_seconds_bucket"
RESULTS = "prunewatch_probe_results_total"
FAILURES = "prunewatch_probe_failures_total"


class NotConvertible(ValueError):
    """These input series describe something stored probe results cannot reproduce."""


@dataclass(frozen=True)
class InputSeries:
    metric: str
    labels: dict[str, str]
    values: list[float | None]  # one per interval from t=0; None is promtool's `_` (no sample)


def expand_values(text: str) -> list[float | None]:
    """promtool's expanding notation: `a`, `_`, `axn`, `a+bxn`, `a-bxn`, `_xn`."""
    out: list[float | None] = []
    for token in text.split():
        if token == "_":
            out.append(None)
            continue
        if m := re.fullmatch(r"_x(\d+)", token):
            out.extend([None] * int(m.group(1)))
            continue
        if m := re.fullmatch(r"(-?[\d.e]+)(?:([+-])([\d.e]+))?x(\d+)", token):
            start, sign, step, n = float(m.group(1)), m.group(2), float(m.group(3) or 0), int(m.group(4))
            step = -step if sign == "-" else step
            out.extend(start + i * step for i in range(n + 1))
            continue
        out.append(float(token))
    return out


def parse_series(text: str) -> tuple[str, dict[str, str]]:
    m = re.fullmatch(r"([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?", text.strip())
    if m is None:
        raise ValueError(f"cannot parse series {text!r}")
    labels = dict(re.findall(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"', m.group(2) or ""))
    return m.group(1), labels


def load_cases(path: Path) -> tuple[timedelta, list[dict[str, Any]]]:
    data = yaml.safe_load(path.read_text())
    return parse_duration(data.get("evaluation_interval", "1m")), data["tests"]


def input_series(case: dict[str, Any]) -> tuple[timedelta, list[InputSeries]]:
    interval = parse_duration(case.get("interval", "1m"))
    series = []
    for raw in case["input_series"]:
        metric, labels = parse_series(raw["series"])
        series.append(InputSeries(metric, labels, expand_values(str(raw["values"]))))
    return interval, series


def _increments(s: InputSeries) -> dict[int, int]:
    """Counter increase per sample index; the first sample must be 0 (no result before t=0)."""
    out: dict[int, int] = {}
    previous: float | None = None
    for i, value in enumerate(s.values):
        if value is None:
            continue
        if previous is None:
            if value != 0:
                raise NotConvertible(f"{s.metric}{s.labels} starts at {value}, not 0")
        else:
            delta = value - previous
            if delta < 0 or delta != int(delta):
                raise NotConvertible(f"{s.metric}{s.labels} changes by {delta} at sample {i}")
            if delta:
                out[i] = int(delta)
        previous = value
    return out


def _bucket_values(series: list[InputSeries]) -> dict[int, list[float]]:
    """Latencies (seconds) observed at each sample index, one inside each bucket an increase fell into."""
    bounds = {float(s.labels["le"]): s for s in series}
    expected = sorted((*LATENCY_BUCKETS, float("inf")))
    if sorted(bounds) != expected:
        raise NotConvertible(f"latency buckets {sorted(bounds)} differ from the collector's {expected}")
    cumulative = {bound: _increments(s) for bound, s in bounds.items()}
    steps = sorted({i for inc in cumulative.values() for i in inc})
    out: dict[int, list[float]] = {}
    for i in steps:
        observed: list[float] = []
        lower, below = 0.0, 0
        for bound in expected:
            count = cumulative[bound].get(i, 0)
            if count < below:
                raise NotConvertible(f"bucket le={bound} grows less than a lower bucket at sample {i}")
            value = (lower + bound) / 2 if bound != float("inf") else lower * 2
            observed.extend([value] * (count - below))
            lower, below = bound, count
        out[i] = observed
    return out


def results_for(case: dict[str, Any]) -> list[ProbeResult]:
    """The probe results whose metrics are this case's input series."""
    interval, series = input_series(case)
    # Keyed by (sample index, model, domain, target): a series without a target label is a result of target ""
    # (an engine's own live traffic), which the store's series show without one, as Prometheus does.
    gauges: dict[tuple[int, str, str, str], dict[str, dict[str, float]]] = defaultdict(dict)
    dense: dict[tuple[int, str, str, str], dict[str, dict[str, float]]] = defaultdict(dict)
    ok_declared: dict[tuple[int, str, str, str], int] = {}
    failed_declared: dict[tuple[int, str, str, str], int] = {}
    failures: dict[tuple[int, str, str, str], list[str]] = defaultdict(list)
    buckets: dict[tuple[str, str, str], list[InputSeries]] = defaultdict(list)
    has_ok_series: set[tuple[str, str, str]] = set()
    for s in series:
        group = (s.labels.get("model", ""), s.labels.get("domain", ""), s.labels.get("target", ""))
        if s.metric in GAUGE_FIELDS or s.metric in DENSE_FIELDS:
            into = gauges if s.metric in GAUGE_FIELDS else dense
            name = GAUGE_FIELDS.get(s.metric) or DENSE_FIELDS[s.metric]
            for i, value in enumerate(s.values):
                if value is not None:
                    into[(i, *group)].setdefault(s.labels["probe"], {})[name] = field_value(s.metric, value)
        elif s.metric in SERIES_GIVEN:
            continue  # given_series
        elif s.metric == RESULTS:
            declared = ok_declared if s.labels["status"] == "ok" else failed_declared
            if s.labels["status"] == "ok":
                has_ok_series.add(group)
            for i, n in _increments(s).items():
                declared[(i, *group)] = n
        elif s.metric == FAILURES:
            for i, n in _increments(s).items():
                failures[(i, *group)].extend([s.labels["reason"]] * n)
        elif s.metric == BUCKET_METRIC:
            buckets[group].append(s)
        elif s.metric == GOVERNOR_CLAMPS_TOTAL:
            continue  # governor decisions, not probe results: decisions_for
        else:
            raise NotConvertible(f"metric {s.metric} is not produced from stored probe results")
    latencies: dict[tuple[int, str, str, str], list[float]] = {}
    for group, bucket_series in buckets.items():
        for i, values in _bucket_values(bucket_series).items():
            latencies[(i, *group)] = values
    keys = set(gauges) | set(dense) | set(ok_declared) | set(failed_declared) | set(failures) | set(latencies)
    results: list[ProbeResult] = []
    for key in sorted(keys):
        i, model, domain, target = key
        at = EPOCH + interval * i
        probes = gauges.get(key, {})
        observed = latencies.get(key, [])
        needed = max(len(probes), len(observed))
        n_ok = ok_declared.get(key, 0) if (model, domain, target) in has_ok_series else needed
        if n_ok < needed:
            raise NotConvertible(f"{n_ok} ok results at {at} cannot carry {needed} samples")
        names = sorted(probes)
        for j in range(n_ok):
            probe = names[j] if j < len(names) else f"{domain}-probe-{j}"
            fields = probes.get(probe, {})
            results.append(_result(at, model, domain, target, probe, "ok", i, len(results), **fields,
                                   inference_ms=observed[j] * 1000 if j < len(observed) else None))
        for probe, fields in sorted(dense.get(key, {}).items()):
            # A round of its own: the latency windows are the case's given series, so the converted baselines
            # must not pair with the pruned results (records/latency_window.py pairs runs of one round).
            results.append(_result(at, model, domain, target, probe, "ok", i, len(results), baseline=True,
                                   sensitivity=0.0, round_id=f"dense-{i}", **fields))
        reasons = failures.get(key, [])
        if key in failed_declared and failed_declared[key] != len(reasons):
            raise NotConvertible(f"{failed_declared[key]} failed results but {len(reasons)} failure reasons at {at}")
        for j, reason in enumerate(reasons):
            results.append(_result(at, model, domain, target, f"{domain}-probe-{j}", "failed", i, len(results),
                                   failure_reason=reason))
    return results


def _result(at: datetime, model: str, domain: str, target: str, probe: str, status: str, step: int, n: int,
            **fields: Any) -> ProbeResult:
    if fields.get("ttft_ms") is not None:
        fields.setdefault("prompt_tokens", PROMPT_TOKENS)
    fields.setdefault("round_id", f"{step:032d}")
    return ProbeResult(target=target, model=model, probe_id=probe, probe_version=1, probe_hash="0" * 16,
                       domain=domain, status=status, result_id=f"{step:020d}{n:012d}", created_at=at, **fields)


def given_series(case: dict[str, Any]) -> list[GaugeSeries]:
    """The case's SERIES_GIVEN inputs as gauge series with promtool's samples (seconds since t=0)."""
    interval, series = input_series(case)
    out = []
    for s in series:
        if s.metric not in SERIES_GIVEN:
            continue
        labels = tuple(sorted({**s.labels, "__name__": s.metric}.items()))
        points = [(interval.total_seconds() * i, v) for i, v in enumerate(s.values) if v is not None]
        out.append(GaugeSeries(labels, [t for t, _ in points], [v for _, v in points]))
    return out


def decisions_for(case: dict[str, Any]) -> list[GovernorDecision]:
    """The governor decisions whose clamp counter is this case's input series: a decision at the series'
    first sample (the counter appears at 0), and one clamp (sensitivity lowered) per increment."""
    interval, series = input_series(case)
    decisions: list[tuple[int, GovernorDecision]] = []
    for s in series:
        if s.metric != GOVERNOR_CLAMPS_TOTAL:
            continue
        first = next((i for i, v in enumerate(s.values) if v is not None), None)
        if first is None:
            continue
        steps = _increments(s)
        for i in sorted({first, *steps}):
            for _ in range(max(1, steps.get(i, 0))):
                clamped = i in steps
                decisions.append((i, GovernorDecision(
                    decided_at=EPOCH + interval * i, target=s.labels["target"], model="probe-llama",
                    domain=s.labels["domain"], old_setting=0.5, new_setting=0.45 if clamped else 0.5,
                    reason="breach" if clamped else "hold", agreement=0.9 if clamped else 0.97, probes=2,
                    good_rounds=0, floor=0.95)))
    return [d for _, d in sorted(decisions, key=lambda pair: pair[0])]
