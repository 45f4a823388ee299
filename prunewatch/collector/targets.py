"""Targets: what a probe runs against. The embedded target runs the engine in this process.

A target's `run_probe` returns the engine's `GenerationResult` (in-process) or an `Observation`
(what a remote server reported); a failure raises, ideally a `TargetError` whose `reason` is the
stable label stored with the failed result.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from prunewatch.engine import GenerationResult, PruningEngine
from prunewatch.engine.hardware import device_model_name
from prunewatch.engine.pruning_engine import TokenDelta
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


class InProcessTarget:
    """The engine in this process; probes always get the quality check against the dense model."""

    def __init__(self, engine: PruningEngine, *, name: str = "embedded", sensitivity: float | None = None,
                 layer_blacklist: Sequence[int] | None = None, quality: bool = True) -> None:
        self.engine = engine
        self.name = name
        self.model = engine.name
        self.device_name = device_model_name(engine.loaded.device)  # stored with each result (its stats carry the type)
        self.sensitivity = sensitivity
        self.layer_blacklist = None if layer_blacklist is None else sorted(set(layer_blacklist))
        self.quality = quality  # score each answer against the dense model (off for dense baseline runs)

    def with_overrides(self, *, sensitivity: float | None = None, layer_blacklist: Sequence[int] | None = None,
                       quality: bool | None = None) -> InProcessTarget:
        """The same engine probed with another sensitivity / blacklist / quality check (tune, baselines)."""
        return InProcessTarget(
            self.engine, name=self.name,
            sensitivity=self.sensitivity if sensitivity is None else sensitivity,
            layer_blacklist=self.layer_blacklist if layer_blacklist is None else layer_blacklist,
            quality=self.quality if quality is None else quality)

    def run_probe(self, probe: Probe, cancel: threading.Event | None = None) -> GenerationResult:
        """Generate token by token on the engine's generation thread (whichever thread asks: a scheduler's, a
        deadline's), so a set `cancel` stops the work at the next token."""
        return self.engine.generation_thread.run(self._generate, probe, cancel)

    def _generate(self, probe: Probe, cancel: threading.Event | None) -> GenerationResult:
        result = None
        stream = self.engine.stream(
            probe.prompt, system=probe.system or None, max_new_tokens=probe.max_tokens,
            sensitivity=self.sensitivity, layer_blacklist=self.layer_blacklist, quality=self.quality,
        )
        try:
            for item in stream:
                if isinstance(item, TokenDelta):
                    if cancel is not None and cancel.is_set():
                        raise ProbeCancelledError(f"probe {probe.id} cancelled after its timeout")
                    continue
                result = item
        finally:
            stream.close()
        if not isinstance(result, GenerationResult):  # stream always ends with its result
            raise RuntimeError("generation ended without a result")
        return result
