"""The collector: runs canonical probes against engines on a schedule and records every result."""

from collector.metrics import CollectorMetrics
from collector.probe_round import RoundSummary, run_round
from collector.results import ProbeResult
from collector.scheduler import ProbeScheduler
from collector.settings import CollectorSettings
from collector.targets import InProcessTarget, Target

__all__ = [
    "CollectorMetrics",
    "CollectorSettings",
    "InProcessTarget",
    "ProbeResult",
    "ProbeScheduler",
    "RoundSummary",
    "Target",
    "run_round",
]
