"""Alerting: Prometheus rules rendered from typed thresholds, Alertmanager to Slack, and an embedded evaluator."""

from prunewatch.alerts.embedded import EmbeddedAlerting, RoundReport, UnsupportedRulesError
from prunewatch.alerts.rules import render_rules
from prunewatch.alerts.ruleset import RuleFileError, load_rules
from prunewatch.alerts.settings import RULES_PATH, AlertingSettings, RuleSettings

__all__ = [
    "RULES_PATH",
    "AlertingSettings",
    "EmbeddedAlerting",
    "RoundReport",
    "RuleFileError",
    "RuleSettings",
    "UnsupportedRulesError",
    "load_rules",
    "render_rules",
]
