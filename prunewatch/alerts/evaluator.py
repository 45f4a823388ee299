"""Alert state with Prometheus' `for:` semantics, driven by an explicit clock.

Per alerting rule and label set: the first evaluation that returns the series makes the alert
pending (active since then); once it has been active for the rule's `for:` it fires; an
evaluation that no longer returns it resolves a firing alert and forgets a pending one. A
resolved alert that comes back starts a new episode. Each episode yields exactly one `firing`
and at most one `resolved` transition, which is what makes "never post the same firing twice"
hold by construction.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from typing import Any

from prunewatch.alerts._engine import Engine, EvaluationError
from prunewatch.alerts._parser import UnsupportedExpression, parse
from prunewatch.alerts._series import NAME, StoreSeries
from prunewatch.alerts._templates import render
from prunewatch.alerts.ruleset import AlertRule, RuleFile

logger = logging.getLogger("prunewatch.alerts")

LabelSet = tuple[tuple[str, str], ...]


@dataclass
class Alert:
    """One alert instance of one rule (Prometheus' unit: rule + label set)."""

    rule: str
    labels: LabelSet  # alertname and rule labels included
    annotations: dict[str, str]
    value: float
    state: str  # "pending" or "firing"
    active_at: datetime
    fired_at: datetime | None = None

    @property
    def key(self) -> str:
        """Identity of this episode: labels plus the instant it became active."""
        labels = ",".join(f'{k}="{v}"' for k, v in self.labels)
        return f"{{{labels}}}@{self.active_at.isoformat()}"

    def label(self, name: str) -> str:
        return dict(self.labels).get(name, "")

    def to_json(self) -> dict[str, Any]:
        return {"rule": self.rule, "labels": [list(p) for p in self.labels], "annotations": self.annotations,
                "value": self.value, "state": self.state, "active_at": self.active_at.isoformat(),
                "fired_at": self.fired_at.isoformat() if self.fired_at else None}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Alert:
        return cls(rule=data["rule"], labels=tuple((str(k), str(v)) for k, v in data["labels"]),
                   annotations=dict(data["annotations"]), value=float(data["value"]), state=data["state"],
                   active_at=datetime.fromisoformat(data["active_at"]),
                   fired_at=datetime.fromisoformat(data["fired_at"]) if data.get("fired_at") else None)


@dataclass(frozen=True)
class Transition:
    """An alert started firing or resolved at `at`."""

    kind: str  # "firing" or "resolved"
    alert: Alert
    at: datetime

    @property
    def key(self) -> str:
        return f"{self.kind}:{self.alert.key}"


@dataclass
class RuleError:
    """A runnable rule failed on this evaluation's data (logged; the rule's alerts keep their state)."""

    rule: str
    message: str


@dataclass
class Evaluation:
    at: datetime
    transitions: list[Transition] = field(default_factory=list)
    errors: list[RuleError] = field(default_factory=list)


def _utc(at: datetime) -> datetime:
    if at.tzinfo is None:
        raise ValueError("evaluation time must be timezone-aware (UTC)")
    return at.astimezone(UTC)


class AlertEvaluator:
    """Keeps pending/firing alerts of every runnable rule of `rules` between evaluations."""

    def __init__(self, rules: RuleFile, lookback: timedelta = timedelta(minutes=5)) -> None:
        self.rules = rules
        self.lookback_s = lookback.total_seconds()
        self._active: dict[int, dict[LabelSet, Alert]] = {i: {} for i in range(len(rules.alerting))}
        self.last_evaluated: datetime | None = None

    def alerts(self, state: str | None = None) -> list[Alert]:
        """Active alerts (optionally only "pending" or "firing"), in rule order."""
        out = [a for i in sorted(self._active) for a in self._active[i].values()]
        return [a for a in out if state is None or a.state == state]

    def evaluate(self, at: datetime, series: StoreSeries) -> Evaluation:
        """Evaluate every runnable rule at `at` over `series` and advance the alerts' states."""
        at = _utc(at)
        evaluation = Evaluation(at=at)
        engine = Engine(series, at.timestamp(), self.lookback_s, self.rules.recorded)

        def query(expr: str) -> list:  # an annotation's `query`: the same data, the same instant
            return engine.vector(parse(expr))

        for index, rule in enumerate(self.rules.alerting):
            try:
                vector = engine.vector(rule.node)
            except (EvaluationError, UnsupportedExpression) as exc:
                evaluation.errors.append(RuleError(rule.name, str(exc)))
                logger.error("alert rule %s failed at %s: %s", rule.name, at.isoformat(), exc)
                continue
            evaluation.transitions.extend(self._step(index, rule, vector, at, query))
        self.last_evaluated = at
        return evaluation

    def _step(self, index: int, rule: AlertRule, vector: list, at: datetime, query=None) -> list[Transition]:
        active = self._active[index]
        seen: set[LabelSet] = set()
        for sample in vector:
            sample_labels = {k: v for k, v in sample.labels}
            extra = {k: render(v, sample_labels, sample.value) for k, v in rule.labels}
            labels = dict((k, v) for k, v in sample.labels if k != NAME)
            labels.update(extra)
            labels["alertname"] = rule.name
            key: LabelSet = tuple(sorted(labels.items()))
            annotations = {k: render(v, sample_labels, sample.value, query) for k, v in rule.annotations}
            seen.add(key)
            if key in active:
                active[key].value, active[key].annotations = sample.value, annotations
            else:
                active[key] = Alert(rule.name, key, annotations, sample.value, "pending", at)
        transitions = []
        for key in list(active):
            alert = active[key]
            if key not in seen:
                del active[key]
                if alert.state == "firing":
                    transitions.append(Transition("resolved", replace(alert), at))
                continue
            if alert.state == "pending" and (at - alert.active_at).total_seconds() >= rule.hold_s:
                alert.state, alert.fired_at = "firing", at
                transitions.append(Transition("firing", replace(alert), at))
        return transitions

    # -- persistence ------------------------------------------------------------------------------
    def export_state(self) -> dict[str, Any]:
        return {"evaluated_at": self.last_evaluated.isoformat() if self.last_evaluated else None,
                "alerts": [a.to_json() for a in self.alerts()]}

    def restore_state(self, data: dict[str, Any], now: datetime) -> int:
        """Take back alerts saved by `export_state`; returns how many were restored.

        Firing alerts always come back (so a restart never re-posts them); pending ones only when
        the gap since the last evaluation is within the lookback, otherwise their `for:` restarts.
        """
        evaluated_at = data.get("evaluated_at")
        gap_ok = evaluated_at is not None and \
            (_utc(now) - datetime.fromisoformat(evaluated_at)).total_seconds() <= self.lookback_s
        restored = 0
        for raw in data.get("alerts", []):
            alert = Alert.from_json(raw)
            if alert.state == "pending" and not gap_ok:
                continue
            labels = dict(alert.labels)
            # The rule of that name whose static labels it carries; of several (a measured rule and its fallback
            # twin, which adds source="fallback"), the most specific one.
            matching = [(len(rule.labels), i) for i, rule in enumerate(self.rules.alerting)
                        if rule.name == alert.rule and all(labels.get(k) == v for k, v in rule.labels)]
            index = max(matching)[1] if matching else None
            if index is None:
                continue  # the rule is gone or changed its labels: that alert cannot be continued
            self._active[index][alert.labels] = alert
            restored += 1
        return restored
