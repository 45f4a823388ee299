"""Typed alerting configuration: rule thresholds (rendered into rules.yml) and the embedded evaluator.

Two objects on purpose: `RuleSettings` decides what the rule file says (Prometheus and the
embedded evaluator both read that file), `AlertingSettings` decides how the embedded evaluator
runs and where it posts. Changing a threshold means rendering a new rule file, never a second
copy of the numbers.
"""

from __future__ import annotations

from datetime import timedelta
from importlib.resources import files
from pathlib import Path

from pydantic import Field, SecretStr, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from prunewatch.alerts.durations import PromDuration

RULES_PATH = Path(str(files("prunewatch.alerts").joinpath("rules.yml")))
"""The committed rule file, rendered from `RuleSettings()` defaults."""

ALERTMANAGER_PATH = Path(str(files("prunewatch.alerts").joinpath("alertmanager.yml")))
"""The committed Alertmanager configuration; the embedded evaluator applies its inhibit_rules."""


class RuleSettings(BaseSettings):
    """Thresholds and hold times of the alert rules (environment: PRUNEWATCH_RULE_*)."""

    model_config = SettingsConfigDict(env_prefix="PRUNEWATCH_RULE_", extra="ignore")

    ratio_low: float = Field(
        0.35, gt=0.0, lt=1.0,
        description="24 h average pruning ratio below this means pruning saves little work (configured default, "
                    "not measured here).")
    thresholds_source: str | None = Field(
        None, max_length=300,
        description="Where the ratio thresholds come from when they were measured (`prunewatch tune` writes it); "
                    "None: configured defaults, and the annotations say so.")
    ratio_low_for: PromDuration = Field(
        timedelta(hours=2), description="How long the 24 h average must stay low before PruningRatioLow fires.")
    quality_red_line: float = Field(
        0.44, gt=0.0, lt=1.0,
        description="Operational red line: above it PruningRatioQualityRisk fires as a warning (configured "
                    "default, not measured here).")
    quality_risk_ratio: float = Field(
        0.45, gt=0.0, le=1.0,
        description="Ratio above which PruningRatioQualityRisk fires as critical (configured default, not "
                    "measured here; token agreement is the measured quality figure).")
    quality_risk_for: PromDuration = Field(
        timedelta(minutes=15), description="How long the ratio must stay above a quality line before it fires.")
    agreement_floor: float = Field(
        0.80, gt=0.0, le=1.0,
        description="1 h average token agreement with the dense model below this fires QualityAgreementLow.")
    agreement_for: PromDuration = Field(timedelta(minutes=30), description="Hold time of QualityAgreementLow.")
    latency_slo_s: float = Field(
        1.3, gt=0.0, le=600.0, description="p99 inference latency SLO in seconds (seeds: 1.3 s).")
    latency_slo_for: PromDuration = Field(timedelta(minutes=10), description="Hold time of LatencySLOBreached.")
    failure_rate_max: float = Field(
        0.2, gt=0.0, lt=1.0, description="Share of failed probe results over 15m above which ProbeFailing fires.")
    probe_failing_for: PromDuration = Field(timedelta(minutes=10), description="Hold time of ProbeFailing.")
    absent_for: PromDuration = Field(
        timedelta(minutes=10),
        description="No probe result for this long fires ProbeDataAbsent (about 20 rounds at the 30 s default).")
    buffer_backlog_max: int = Field(
        100, ge=1, le=10_000_000,
        description="Results waiting on disk for the database above this fire CollectorBufferBacklog.")
    buffer_backlog_for: PromDuration = Field(timedelta(minutes=10), description="Hold time of CollectorBufferBacklog.")
    governor_clamp_window: PromDuration = Field(
        timedelta(minutes=15),
        description="PruningGovernorClamped fires while the governor lowered a sensitivity within this window "
                    "(at once, no hold: each clamp is already a measured breach of the agreement floor).")
    ratio_buckets: tuple[float, float, float] = Field(
        (0.35, 0.42, 0.47),
        description="Upper bounds of the ratio buckets [0,a), [a,b), [b,c] (seeds: 0.35, 0.42, 0.47); "
                    "a fourth bucket (c,1] counts the rest.")

    @model_validator(mode="after")
    def _ordered(self) -> RuleSettings:
        if not self.ratio_low < self.quality_red_line <= self.quality_risk_ratio:
            raise ValueError("thresholds must satisfy ratio_low < quality_red_line <= quality_risk_ratio "
                             f"(got {self.ratio_low}, {self.quality_red_line}, {self.quality_risk_ratio})")
        a, b, c = self.ratio_buckets
        if not 0.0 < a < b < c < 1.0:
            raise ValueError(f"ratio_buckets must be increasing inside (0, 1) (got {self.ratio_buckets})")
        for name in ("ratio_low_for", "quality_risk_for", "agreement_for", "latency_slo_for", "probe_failing_for",
                     "buffer_backlog_for"):
            if getattr(self, name) < timedelta(0):
                raise ValueError(f"{name} must not be negative")
        if self.absent_for <= timedelta(0):
            raise ValueError("absent_for must be positive")
        if self.governor_clamp_window <= timedelta(0):
            raise ValueError("governor_clamp_window must be positive")
        return self


class AlertingSettings(BaseSettings):
    """How the embedded evaluator runs (environment: PRUNEWATCH_ALERT_*); secrets are masked when printed."""

    model_config = SettingsConfigDict(env_prefix="PRUNEWATCH_ALERT_", extra="ignore")

    rules_path: Path = Field(RULES_PATH, description="Rule file to evaluate; the same file Prometheus loads.")
    alertmanager_path: Path | None = Field(
        ALERTMANAGER_PATH,
        description="Alertmanager config whose inhibit_rules the evaluator applies (None: nothing is muted).")
    lookback: PromDuration = Field(
        timedelta(minutes=5),
        description="How far back an instant selector looks for a gauge's last sample (Prometheus' default 5m).")
    slack_webhook_url: SecretStr | None = Field(
        None, description="Slack incoming-webhook URL; unset (and no URL file) means alerts are only logged.")
    slack_webhook_url_file: Path | None = Field(
        None, description="File holding the webhook URL (a mounted secret), read when posting.")
    notify_attempts: int = Field(4, ge=1, le=10, description="Tries per Slack message within one round.")
    notify_backoff_s: float = Field(1.0, ge=0.0, le=60.0, description="Delay before the first retry; doubles each try.")
    notify_backoff_max_s: float = Field(8.0, ge=0.0, le=300.0, description="Longest delay between two tries.")
    notify_timeout_s: float = Field(5.0, gt=0.0, le=60.0, description="HTTP timeout of one post.")
    notify_budget_s: float = Field(
        20.0, gt=0.0, le=600.0,
        description="Wall time one round may spend posting; undelivered messages wait for the next round.")
    outbox_max: int = Field(200, ge=1, le=100_000, description="Undelivered messages kept; the oldest go first.")
    state_path: Path | None = Field(
        Path("prunewatch-alerts.json"),
        description="JSON file keeping alert state and delivered messages across restarts (None: memory only, "
                    "so a restart may post a still-firing alert again).")
    strict: bool = Field(
        False, description="Refuse to start when an alerting rule cannot be evaluated without Prometheus.")

    @model_validator(mode="after")
    def _one_url(self) -> AlertingSettings:
        if self.slack_webhook_url is not None and self.slack_webhook_url_file is not None:
            raise ValueError("set slack_webhook_url or slack_webhook_url_file, not both")
        if self.notify_backoff_max_s < self.notify_backoff_s:
            raise ValueError("notify_backoff_max_s must be at least notify_backoff_s")
        if self.lookback <= timedelta(0):
            raise ValueError("lookback must be positive")
        return self
