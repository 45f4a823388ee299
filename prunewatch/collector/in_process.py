"""The in-process target: the pruning engine, loaded in the collector's own process (imports torch)."""

from __future__ import annotations

import threading
from collections.abc import Sequence

from prunewatch.collector.targets import ProbeCancelledError
from prunewatch.engine import GenerationResult, PruningEngine
from prunewatch.engine.hardware import device_model_name
from prunewatch.engine.pruning_engine import TokenDelta
from prunewatch.probes import Probe


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
