"""Targets: what a probe runs against, and how a probe fails.

A target's `run_probe` returns the engine's `GenerationResult` (in-process, collector/in_process.py) or an
`Observation` (what a remote server reported, collector/http_target.py); a failure raises, ideally a
`TargetError` whose `reason` is the stable label stored with the failed result. Nothing here imports the
engine: a collector that only probes HTTP targets runs without torch.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from prunewatch.engine.stats import GenerationResult
from prunewatch.probes import Probe
from prunewatch.records.results import ProbeResult


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

    def to_result(self, *, target: str, probe: Probe, round_id: str, duration_ms: float) -> ProbeResult: ...


class Target(Protocol):
    name: str
    model: str

    def run_probe(self, probe: Probe) -> GenerationResult | Observation: ...


class CancellableTarget(Target, Protocol):
    """A target whose probe gives up when `cancel` is set, so a timed-out probe stops using the engine."""

    def run_probe(self, probe: Probe, cancel: threading.Event | None = None) -> GenerationResult | Observation: ...


class TunableTarget(Target, Protocol):
    """A target that can be probed at another sensitivity or blacklist (tune sweeps, dense baselines)."""

    def with_overrides(self, *, sensitivity: float | None = None, layer_blacklist: Sequence[int] | None = None,
                       quality: bool | None = None) -> Target: ...
