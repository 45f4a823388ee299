"""The collector: runs canonical probes against engines on a schedule and records every result."""

from collector.fleet import FleetSettings, build_jobs, run_collector
from collector.http_target import HttpTarget
from collector.metrics import CollectorMetrics
from collector.probe_round import RoundSummary, run_round
from collector.results import ProbeResult
from collector.scheduler import ProbeScheduler, TargetJob
from collector.settings import CollectorSettings
from collector.target_config import TargetConfigError, load_targets
from collector.targets import InProcessTarget, Target

__all__ = [
    "CollectorMetrics",
    "CollectorSettings",
    "FleetSettings",
    "HttpTarget",
    "InProcessTarget",
    "ProbeResult",
    "ProbeScheduler",
    "RoundSummary",
    "Target",
    "TargetConfigError",
    "TargetJob",
    "build_jobs",
    "load_targets",
    "run_collector",
    "run_round",
]
