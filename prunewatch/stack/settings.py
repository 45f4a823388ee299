"""What `prunewatch stack up` starts and how long it waits (flags or PRUNEWATCH_STACK_* variables)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from prunewatch.collector.settings import INTERVAL_ENV
from prunewatch.engine.model_store import PROBE_MODEL_DIR
from prunewatch.probes import DEFAULT_PROBES_PATH

DEFAULT_STATE_DIR = Path(".prunewatch") / "stack"
# The bundled probe model (the same folder prunewatch.collector.settings names; not imported from there,
# so `stack down` does not pay for importing the collector and torch).


class StackSettings(BaseSettings):
    """The local stack: the docker-compose topology as processes on 127.0.0.1, without Docker."""

    model_config = SettingsConfigDict(env_prefix="PRUNEWATCH_STACK_", extra="ignore", populate_by_name=True)

    state_dir: Path = Field(
        DEFAULT_STATE_DIR,
        description="Holds every generated config, secret, pid, log and the PostgreSQL cluster; "
                    "`stack down` reads it to stop what `stack up` started.")
    model_dir: Path = Field(PROBE_MODEL_DIR,
                            description="Model folder every engine serves (its folder name is the model id).")
    engines: int = Field(2, ge=1, le=8, description="Engine servers to start; the collector probes each one.")
    device: Literal["auto", "cpu", "cuda"] = Field(
        "cpu", description="Engine device. cpu by default: two engines on one GPU would share its memory.")
    sensitivity: float = Field(0.5, ge=0.0, le=1.0, description="Pruning sensitivity the collector asks for.")
    probes_path: Path = Field(DEFAULT_PROBES_PATH, description="Probes the collector sends to every engine.")
    interval_s: float = Field(30.0, ge=1.0, le=86_400.0, validation_alias=INTERVAL_ENV,
                              description="Seconds between probe rounds per engine (PRUNEWATCH_INTERVAL_S).")
    baseline_every: int = Field(
        10, ge=1, le=100_000,
        description="Every N rounds (the first included) each engine's probes also run dense: the measured "
                    "'before' of the ROI app and the dense lines of the pruned-vs-dense panel.")
    probe_timeout_s: float = Field(120.0, gt=0.0, le=3600.0, description="A probe running longer is a timeout failure.")
    scrape_interval_s: int = Field(
        15, ge=1, le=300,
        description="Prometheus scrape and rule-evaluation interval (15 s as in the compose stack).")
    alert_group_wait_s: int | None = Field(
        None, ge=0, le=3600,
        description="Override of Alertmanager's group_wait (None keeps prunewatch/alerts/alertmanager.yml's 30s).")
    calibration_dir: Path | None = Field(
        None, description="Calibration cache shared by the engines (None: the engine's default cache).")
    start_timeout_s: float = Field(
        180.0, gt=0.0, le=3600.0, description="Longest wait for one service to answer its readiness check.")
    stop_timeout_s: float = Field(
        20.0, gt=0.0, le=600.0,
        description="Longest wait for one service to exit after its stop signal before it is killed.")

    @field_validator("model_dir")
    @classmethod
    def _model_folder(cls, value: Path) -> Path:
        if not (value / "config.json").is_file():
            raise ValueError(f"{value} has no config.json (not a Hugging Face model folder)")
        return value

    @field_validator("probes_path")
    @classmethod
    def _probes_file(cls, value: Path) -> Path:
        if not value.is_file():
            raise ValueError(f"probes file not found: {value}")
        return value
