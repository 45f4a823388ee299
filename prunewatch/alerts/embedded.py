"""Alerting without Prometheus: evaluate rules.yml over the store after each collector round, post to Slack.

Usage from the embedded collector (one instance for the process, called from the round callback):

    alerting = EmbeddedAlerting(AlertingSettings(), db_engine)   # db_engine: the store's SQLAlchemy Engine
    ...
    alerting.after_round(utcnow())                                # never raises; returns a RoundReport

Every message is queued in an outbox before it is posted, and its key (transition + alert labels
+ the instant the alert became active) is remembered once Slack took it, so a message is posted
at most once even across restarts (with `state_path`), and one Slack could not take waits for the
next round instead of being lost.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from sqlalchemy import Engine

from prunewatch.alerts._engine import Engine as PromQLEngine
from prunewatch.alerts._parser import parse
from prunewatch.alerts._series import GaugeSeries, StoreSeries, threshold_series
from prunewatch.alerts.evaluator import AlertEvaluator, Evaluation, Transition
from prunewatch.alerts.history import StoreHistory
from prunewatch.alerts.inhibit import is_muted, load_inhibit_rules
from prunewatch.alerts.ruleset import UnsupportedRule, load_rules
from prunewatch.alerts.settings import AlertingSettings
from prunewatch.alerts.slack import RetryPolicy, SlackWebhook, slack_payload
from prunewatch.records.operating_range import Threshold

logger = logging.getLogger("prunewatch.alerts")

STATE_VERSION = 1
DELIVERED_KEPT = 2000  # remembered message keys; far more than the episodes a state file outlives


class UnsupportedRulesError(RuntimeError):
    """Strict mode: some alerting rules cannot be evaluated without Prometheus."""


@dataclass
class OutboxEntry:
    key: str
    payload: dict[str, Any]
    queued_at: str
    attempts: int = 0


@dataclass
class RoundReport:
    """What one `after_round` did; `error` is set when evaluation itself failed (already logged)."""

    at: datetime
    transitions: list[Transition] = field(default_factory=list)
    delivered: int = 0
    undelivered: int = 0
    error: str | None = None


def _describe(transition: Transition) -> str:
    labels = ", ".join(f"{k}={v}" for k, v in transition.alert.labels if k != "alertname")
    return f"{transition.alert.rule}{{{labels}}} value={transition.alert.value:.4g}"


class EmbeddedAlerting:
    """The embedded evaluator over one store, with its Slack outbox and persisted state."""

    def __init__(self, settings: AlertingSettings, store: Engine, *, sleep: Callable[[float], None] = time.sleep,
                 clock: Callable[[], float] = time.monotonic, thresholds: Iterable[Threshold] = (),
                 extra_series: Iterable[GaugeSeries] = ()) -> None:
        """`thresholds`: the watched models' measured alert thresholds (records/operating_range.py), evaluated as
        the collector exports them; a model without them takes the rules' fallbacks. `extra_series`: other gauges
        the store cannot give, as series (tests replaying promtool's inputs)."""
        self.settings = settings
        self.thresholds: list[Threshold] = list(thresholds)
        self._extra = list(extra_series)
        lookback_s = settings.lookback.total_seconds()
        rules = load_rules(settings.rules_path, lookback_s)
        for rule in rules.unsupported:
            logger.warning("alert rule %s/%s is not evaluated without Prometheus: %s", rule.group, rule.name,
                           rule.reason)
        if settings.strict and rules.unsupported:
            raise UnsupportedRulesError("alert rules not evaluable without Prometheus: "
                                        + "; ".join(str(r) for r in rules.unsupported))
        self.evaluator = AlertEvaluator(rules, settings.lookback)
        self.inhibit_rules = load_inhibit_rules(settings.alertmanager_path) if settings.alertmanager_path else []
        self.history = StoreHistory(store, timedelta(seconds=rules.horizon_s(lookback_s)))
        self._clock = clock
        self.webhook: SlackWebhook | None = None
        if settings.slack_webhook_url is not None or settings.slack_webhook_url_file is not None:
            policy = RetryPolicy(settings.notify_attempts, settings.notify_backoff_s, settings.notify_backoff_max_s,
                                 settings.notify_timeout_s)
            self.webhook = SlackWebhook(self._webhook_url, policy, sleep=sleep, clock=clock)
        else:
            logger.warning("Slack is not configured (PRUNEWATCH_ALERT_SLACK_WEBHOOK_URL or _FILE): alerts are "
                           "evaluated and logged only")
        self.outbox: list[OutboxEntry] = []
        self.delivered: dict[str, str] = {}  # message key -> when Slack took it
        self.muted: set[str] = set()  # alert episodes whose firing an inhibit rule muted (so is their resolution)
        self._state_restored = False

    def set_thresholds(self, thresholds: Iterable[Threshold]) -> None:
        """Replace the measured thresholds the rules compare with (e.g. after a model's range was measured)."""
        self.thresholds = list(thresholds)

    def _series(self, at: datetime) -> StoreSeries:
        return StoreSeries(self.history.results(at), self.history.decisions(at),
                           extra=[*threshold_series(self.thresholds), *self._extra])

    @property
    def unsupported(self) -> list[UnsupportedRule]:
        """Alerting rules of the file this evaluator does not run, with the reason for each."""
        return self.evaluator.rules.unsupported

    def _webhook_url(self) -> str:
        if self.settings.slack_webhook_url is not None:
            return self.settings.slack_webhook_url.get_secret_value()
        path = self.settings.slack_webhook_url_file
        if path is None:
            raise OSError("no Slack webhook URL configured")
        return path.read_text().strip()

    # -- evaluation ------------------------------------------------------------------------------
    def evaluate(self, at: datetime) -> Evaluation:
        """Evaluate all runnable rules at `at` over the store and queue a message per transition."""
        if at.tzinfo is None:
            raise ValueError("evaluation time must be timezone-aware (UTC)")
        self._restore_once(at)
        evaluation = self.evaluator.evaluate(at, self._series(at))
        firing = [dict(alert.labels) for alert in self.evaluator.alerts("firing")]
        for transition in evaluation.transitions:
            level = logging.WARNING if transition.kind == "firing" else logging.INFO
            logger.log(level, "alert %s: %s", transition.kind, _describe(transition))
            episode = transition.alert.key
            if transition.kind == "firing" and is_muted(dict(transition.alert.labels), firing, self.inhibit_rules):
                self.muted.add(episode)
                logger.info("not posting %s: muted by an inhibit rule of %s", _describe(transition),
                            self.settings.alertmanager_path)
            elif transition.kind == "resolved" and episode in self.muted:
                self.muted.discard(episode)
            else:
                self._queue(transition)
        for alert in self.evaluator.alerts("firing"):  # muted, but its inhibiting alert has gone: post it now
            if alert.key in self.muted and not is_muted(dict(alert.labels), firing, self.inhibit_rules):
                self.muted.discard(alert.key)
                self._queue(Transition("firing", alert, at))
        return evaluation

    def query(self, expr: str, at: datetime) -> list[tuple[dict[str, str], float]]:
        """Evaluate one PromQL expression (recording-rule names allowed) at `at` over the store.

        Raises `UnsupportedExpression` / `PromQLSyntaxError` for expressions outside the subset.
        """
        if at.tzinfo is None:
            raise ValueError("evaluation time must be timezone-aware (UTC)")
        engine = PromQLEngine(self._series(at), at.timestamp(), self.settings.lookback.total_seconds(),
                              self.evaluator.rules.recorded)
        return [(dict(s.labels), s.value) for s in engine.vector(parse(expr))]

    def _queue(self, transition: Transition) -> None:
        if self.webhook is None:
            return
        key = transition.key
        if key in self.delivered or any(entry.key == key for entry in self.outbox):
            return
        self.outbox.append(OutboxEntry(key, slack_payload(transition), transition.at.isoformat()))
        while len(self.outbox) > self.settings.outbox_max:
            dropped = self.outbox.pop(0)
            logger.error("Slack outbox full (%d): dropped undelivered message %s", self.settings.outbox_max,
                         dropped.key)

    def deliver(self) -> tuple[int, int]:
        """Post queued messages oldest first within the round's budget; returns (delivered, still queued)."""
        if self.webhook is None:
            return 0, 0
        deadline = self._clock() + self.settings.notify_budget_s
        delivered = 0
        while self.outbox and self._clock() < deadline:
            entry = self.outbox[0]
            outcome = self.webhook.post(entry.payload, deadline)
            entry.attempts += outcome.attempts
            if outcome.delivered:
                self.outbox.pop(0)
                self.delivered[entry.key] = datetime.now(UTC).isoformat()
                delivered += 1
                continue
            if not outcome.retryable:
                self.outbox.pop(0)
                logger.error("Slack refused message %s (%s); not retried: check the webhook URL", entry.key,
                             outcome.detail)
                continue
            logger.warning("Slack unreachable (%s) after %d attempts; %d message(s) wait for the next round",
                           outcome.detail, entry.attempts, len(self.outbox))
            break
        while len(self.delivered) > DELIVERED_KEPT:
            self.delivered.pop(next(iter(self.delivered)))
        return delivered, len(self.outbox)

    def after_round(self, now: datetime | None = None) -> RoundReport:
        """Evaluate at `now`, post what is due, save state. Never raises: a collector round must not fail here."""
        at = now if now is not None else datetime.now(UTC)
        report = RoundReport(at=at)
        try:
            report.transitions = self.evaluate(at).transitions
        except Exception as exc:  # logged and reported; the collector keeps probing
            logger.exception("alert evaluation at %s failed", at.isoformat())
            report.error = f"{type(exc).__name__}: {exc}".splitlines()[0]
        try:
            report.delivered, report.undelivered = self.deliver()
        except Exception as exc:
            logger.exception("posting alerts to Slack failed")
            report.error = report.error or f"{type(exc).__name__}: {exc}".splitlines()[0]
        self.save_state()
        return report

    # -- persistence -----------------------------------------------------------------------------
    def save_state(self) -> None:
        """Write alerts, outbox and delivered keys to `state_path` atomically (no-op without a path)."""
        path = self.settings.state_path
        if path is None:
            return
        data = {"version": STATE_VERSION, "rules_path": str(self.settings.rules_path),
                "evaluator": self.evaluator.export_state(),
                "outbox": [entry.__dict__ for entry in self.outbox], "delivered": self.delivered,
                "muted": sorted(self.muted)}
        tmp = path.with_name(path.name + ".tmp")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
            os.replace(tmp, path)
        except OSError as exc:
            logger.error("cannot save alert state to %s: %s", path, exc.strerror or exc)

    def _restore_once(self, now: datetime) -> None:
        if self._state_restored:
            return
        self._state_restored = True
        path = self.settings.state_path
        if path is None or not path.exists():
            return
        try:
            data = json.loads(Path(path).read_text())
            if data.get("version") != STATE_VERSION:
                raise ValueError(f"state version {data.get('version')!r}, expected {STATE_VERSION}")
            restored = self.evaluator.restore_state(data.get("evaluator", {}), now)
            self.outbox = [OutboxEntry(**entry) for entry in data.get("outbox", [])]
            self.delivered = dict(data.get("delivered", {}))
            self.muted = set(data.get("muted", []))
        except (OSError, ValueError, TypeError, KeyError) as exc:
            logger.error("ignoring unreadable alert state %s: %s", path, exc)
            return
        logger.info("restored %d active alert(s) and %d queued message(s) from %s", restored, len(self.outbox), path)
