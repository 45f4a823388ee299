"""The alert rule file (prunewatch/alerts/rules.yml) as the dashboards need it: recording rules, buckets, alert names.

Panels query the recording rules rather than re-typing their PromQL, so a dashboard shows the very
series an alert evaluates. The file, not the Python that renders it, is read: it is what
Prometheus loads, so the dashboards follow whatever thresholds were rendered into it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from prunewatch.alerts.ruleset import RuleFileError, read_rule_groups
from prunewatch.alerts.settings import RULES_PATH

_BUCKET_LABEL = re.compile(r"^([\[(])\s*([0-9.]+)\s*,\s*([0-9.]+)\s*([\])])$")


@dataclass(frozen=True)
class RatioBucket:
    """One pruning-ratio bucket as the recording rules label it, e.g. "[0.35,0.42)"."""

    label: str
    low: float
    high: float
    low_inclusive: bool
    high_inclusive: bool


@dataclass(frozen=True)
class RecordedFigures:
    """What the panels read from the rule file (prunewatch.alerts.ruleset reads it): recorded series, buckets, alert names."""

    recording: dict[str, str]  # expression -> recorded series name
    bucket_metric: str  # recorded series holding per-bucket probe counts
    buckets: tuple[RatioBucket, ...]  # ascending, contiguous
    alert_names: tuple[str, ...]  # distinct, in file order


def parse_bucket(label: str) -> RatioBucket:
    match = _BUCKET_LABEL.match(label)
    if not match:
        raise RuleFileError(f"ratio bucket label {label!r} is not an interval such as [0.35,0.42)")
    return RatioBucket(label=label, low=float(match.group(2)), high=float(match.group(3)),
                       low_inclusive=match.group(1) == "[", high_inclusive=match.group(4) == "]")


def _check_contiguous(buckets: list[RatioBucket]) -> None:
    for before, after in zip(buckets, buckets[1:]):
        if before.high != after.low or before.high_inclusive == after.low_inclusive:
            raise RuleFileError(f"ratio buckets {before.label} and {after.label} are not contiguous")


@lru_cache(maxsize=4)
def load_rule_file(path: Path = RULES_PATH) -> RecordedFigures:
    """Read the rule file once; raises RuleFileError when it has no recording rules or buckets."""
    recording: dict[str, str] = {}
    bucket_metrics: set[str] = set()
    buckets: list[RatioBucket] = []
    alert_names: list[str] = []
    for _group, rule in read_rule_groups(path):
        if "record" in rule:
            bucket = (rule.get("labels") or {}).get("bucket")
            if bucket is None:
                recording[" ".join(rule["expr"].split())] = rule["record"]
            else:
                bucket_metrics.add(rule["record"])
                buckets.append(parse_bucket(bucket))
        elif rule["alert"] not in alert_names:
            alert_names.append(rule["alert"])
    if len(bucket_metrics) != 1 or not buckets:
        raise RuleFileError(f"{path} must record ratio-bucket counts under one series name with a bucket label")
    buckets.sort(key=lambda b: b.low)
    _check_contiguous(buckets)
    return RecordedFigures(recording=recording, bucket_metric=bucket_metrics.pop(), buckets=tuple(buckets),
                    alert_names=tuple(alert_names))


def recorded(expr: str, path: Path = RULES_PATH) -> str:
    """The recording rule name that records exactly `expr` (whitespace-insensitive)."""
    rules = load_rule_file(path)
    try:
        return rules.recording[" ".join(expr.split())]
    except KeyError:
        raise RuleFileError(f"no recording rule in {path} records {expr!r}") from None
