"""Targets: what a probe runs against, and how a probe fails.

A target's `run_probe` returns the engine's `GenerationResult` (in-process, collector/in_process.py) or an
`Observation` (what a remote server reported, collector/http_target.py); a failure raises, ideally a
`TargetError` whose `reason` is the stable label stored with the failed result. Nothing here imports the
engine: a collector that only probes HTTP targets runs without torch.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from prunewatch.engine.stats import GenerationResult
from prunewatch.probes import Probe


class TargetError(Exception):
    """A probe failed for a reason the collector records as `failure_reason`."""

    reason = "exception"


class ProbeTimeoutError(TargetError, TimeoutError):
    """The probe overran its target's timeout and was abandoned."""

    reason = "timeout"


class ProbeCancelledError(TargetError):
    """The probe was stopped from outside (its timeout passed, or the collector is stopping)."""

    reason = "timeout"


@runtime_checkable
class Observation(Protocol):
    """What a remote target measured; turns itself into the collector's ProbeResult."""

    def to_result(self, *, target: str, probe: Probe, round_id: str, duration_ms: float): ...


class Target(Protocol):
    name: str
    model: str

    def run_probe(self, probe: Probe) -> GenerationResult | Observation: ...
