"""The collector: runs canonical probes against engines on a schedule and records every result.

The public surface is resolved on first use, so that reading results (alerts, dashboards, ROI)
does not load the engine and torch.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

_EXPORTS = {
    "CollectorSettings": "collector.settings",
    "FleetSettings": "collector.fleet",
    "HttpTarget": "collector.http_target",
    "InProcessTarget": "collector.targets",
    "ProbeScheduler": "collector.scheduler",
    "RoundSummary": "collector.probe_round",
    "Target": "collector.targets",
    "TargetConfigError": "collector.target_config",
    "TargetJob": "collector.scheduler",
    "build_jobs": "collector.fleet",
    "load_targets": "collector.target_config",
    "run_collector": "collector.fleet",
    "run_round": "collector.probe_round",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'collector' has no attribute {name!r}")
    value = getattr(import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value
