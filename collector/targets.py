"""Targets: what a probe runs against. The embedded target runs the engine in this process."""

from __future__ import annotations

from typing import Protocol

from engine import GenerationResult, PruningEngine
from probes import Probe


class Target(Protocol):
    name: str
    model: str

    def run_probe(self, probe: Probe) -> GenerationResult: ...


class InProcessTarget:
    """The engine in this process; probes always get the quality check against the dense model."""

    def __init__(self, engine: PruningEngine, *, name: str = "embedded", sensitivity: float | None = None) -> None:
        self.engine = engine
        self.name = name
        self.model = engine.name
        self.sensitivity = sensitivity

    def run_probe(self, probe: Probe) -> GenerationResult:
        return self.engine.generate(
            probe.prompt, system=probe.system or None, max_new_tokens=probe.max_tokens,
            sensitivity=self.sensitivity, quality=True,
        )
