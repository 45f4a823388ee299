"""The local stack's config files: the compose stack's configs with 127.0.0.1 ports and state-dir paths.

Same rule file (prunewatch/alerts/rules.yml), same Alertmanager routes and templates (prunewatch/alerts/alertmanager.yml),
same scrape job names and the same API-key arrangement as docker-compose.yml: only addresses and
file paths differ. Engines are listed in a file_sd file, the way engines on several hosts are
discovered in production (README "Scale-out").
"""

from __future__ import annotations

import json
import os
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

COLLECTOR_JOB = "prunewatch-collector"
ENGINE_JOB = "prunewatch-engine"
TARGET_KEY_ENV = "PRUNEWATCH_TARGET_API_KEY"
"""Variable the collector reads the engines' API key from (its targets file names it in api_key_env)."""


@dataclass(frozen=True)
class EngineEndpoint:
    name: str
    port: int

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def write_private(path: Path, text: str) -> Path:
    """Write a secret readable by its owner only (created 0600, never world-readable even briefly)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as handle:
        handle.write(text)
    path.chmod(0o600)  # an older file keeps its mode through O_TRUNC
    return path


def engine_api_key(secrets_dir: Path) -> Path:
    """The engines' bearer key file, made once per state dir."""
    path = secrets_dir / "engine-api-key"
    if not path.is_file():
        write_private(path, secrets.token_urlsafe(32) + "\n")
    return path


def targets_config(engines: list[EngineEndpoint], *, model: str, probes_path: Path, buffer_path: Path,
                   metrics_port: int, interval_s: float, timeout_s: float, sensitivity: float,
                   baseline_every: int | None = None) -> dict[str, Any]:
    """The collector's targets file: one `prunewatch` HTTP target per engine."""
    return {
        "collector": {"buffer_path": str(buffer_path), "metrics_host": "127.0.0.1", "metrics_port": metrics_port,
                      "probes_path": str(probes_path)},
        "defaults": {"interval_s": interval_s, "timeout_s": timeout_s, "sensitivity": sensitivity,
                     "baseline_every": baseline_every},
        "targets": [{"name": e.name, "kind": "prunewatch", "base_url": e.base_url, "api_key_env": TARGET_KEY_ENV,
                     "model": model} for e in engines],
    }


def prometheus_config(*, collector_port: int, engines_file: Path, alertmanager_port: int, key_file: Path,
                      scrape_interval_s: int) -> dict[str, Any]:
    """Scrape the collector and every engine listed in `engines_file`; load the committed rules."""
    from prunewatch.alerts.settings import RULES_PATH  # imported here: `stack down` needs none of the alerting code

    interval = f"{scrape_interval_s}s"
    return {
        "global": {"scrape_interval": interval, "evaluation_interval": interval},
        "rule_files": [str(RULES_PATH)],
        "alerting": {"alertmanagers": [{"static_configs": [{"targets": [f"127.0.0.1:{alertmanager_port}"]}]}]},
        "scrape_configs": [
            {"job_name": COLLECTOR_JOB, "static_configs": [{"targets": [f"127.0.0.1:{collector_port}"]}]},
            {"job_name": ENGINE_JOB, "metrics_path": "/metrics",
             "authorization": {"type": "Bearer", "credentials_file": str(key_file)},
             "file_sd_configs": [{"files": [str(engines_file)], "refresh_interval": "30s"}]},
        ],
    }


def engines_file_sd(engines: list[EngineEndpoint]) -> list[dict[str, Any]]:
    """Prometheus file_sd entries: one target group per engine, labelled with its collector target name."""
    return [{"targets": [f"127.0.0.1:{e.port}"], "labels": {"engine": e.name}} for e in engines]


def alertmanager_config(secrets_dir: Path, sink_port: int,
                        group_wait_s: int | None) -> tuple[dict[str, Any], list[Path]]:
    """prunewatch/alerts/alertmanager.yml with each api_url_file moved into the state dir, pointing at the Slack sink.

    Each webhook file gets the sink URL plus the file's name as its path, so the sink's log tells
    which receiver (critical or warning channel) a message was routed to.
    """
    from prunewatch.alerts.settings import ALERTMANAGER_PATH

    config = yaml.safe_load(ALERTMANAGER_PATH.read_text())
    written: list[Path] = []
    for receiver in config.get("receivers", []):
        for slack in receiver.get("slack_configs", []):
            name = Path(slack["api_url_file"]).name
            path = secrets_dir / name
            if path not in written:
                write_private(path, f"http://127.0.0.1:{sink_port}/{name}\n")
                written.append(path)
            slack["api_url_file"] = str(path)
    if group_wait_s is not None:
        config["route"]["group_wait"] = f"{group_wait_s}s"
    return config, written


def write_yaml(path: Path, document: Any) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(document, sort_keys=False))
    return path


def write_json(path: Path, document: Any) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(document, indent=1) + "\n")
    tmp.replace(path)  # file_sd readers never see half a file
    return path
