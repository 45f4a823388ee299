"""Collector configuration: typed, ranged, from flags or PRUNEWATCH_* environment variables."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from prunewatch.engine.model_store import PROBE_MODEL_DIR
from prunewatch.probes import DEFAULT_PROBES_PATH
from prunewatch.records.settings import DEFAULT_STORE_URL

ENV_PREFIX = "PRUNEWATCH_"
INTERVAL_ENV = f"{ENV_PREFIX}INTERVAL_S"
"""The one environment variable of the probe interval: `run`, `collect` and `stack up` read it."""


BASELINE_EVERY = 10
"""Dense baselines every 10th round by default (the first included): at the 30 s interval a dense run of every
probe each 5 minutes, so the latency rules' hour always holds several, for about a tenth more probe time."""


class CollectorSettings(BaseSettings):
    """How the embedded collector runs: what it probes, how often, where results go."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="ignore")

    db_url: str = Field(DEFAULT_STORE_URL, description="Any SQLAlchemy URL (PRUNEWATCH_DB_URL); SQLite file by default.")
    interval_s: float = Field(30.0, ge=1.0, le=86_400.0, description="Seconds between probe rounds.")
    rounds: int | None = Field(None, ge=1, description="Stop after this many rounds; None runs until stopped.")
    metrics_host: str = Field("127.0.0.1", description="Address the /metrics endpoint binds to.")
    metrics_port: int = Field(9464, ge=0, le=65535, description="/metrics port; 0 disables the endpoint.")
    model_dir: Path = Field(PROBE_MODEL_DIR, description="Model folder of the embedded engine.")
    device: str = Field("auto", pattern="^(auto|cpu|cuda)$", description="Embedded engine device.")
    sensitivity: float = Field(0.5, ge=0.0, le=1.0, description="Pruning sensitivity of the probes.")
    activation_sparsity: float | None = Field(
        None, ge=0.0, lt=1.0,
        description="Activation-sparsity target at sensitivity 1; None keeps the engine's default, 0 turns it off.")
    probes_path: Path = Field(DEFAULT_PROBES_PATH, description="Canonical probes YAML.")
    target_name: str = Field("embedded", min_length=1, max_length=128, description="Label of the target.")
    baseline_every: int = Field(
        BASELINE_EVERY, ge=0, le=100_000,
        description="Every N rounds (the first included) also run each probe dense (sensitivity 0), stored as a "
                    "baseline: the measured 'before' of the ROI report and the dense side of the latency rules. "
                    "0: never.")
    operating_range: bool = Field(
        True,
        description="Measure the model's operating range (its alert thresholds) on the evaluation prompts when none "
                    "is cached for its weights (once per model, at the engine's default configuration).")
    alerts: bool = Field(True, description="Evaluate prunewatch/alerts/rules.yml over the store after each round (no Prometheus).")
    misfire_grace_s: float = Field(
        60.0, ge=1.0, description="A round that starts this late is still run (then coalesced)."
    )
