"""The engine's sparsity calibration on disk: a JSON file beside its block calibration, named by allocation and
score, reused while it was made for the engine's settings and recalibrated otherwise."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from prunewatch.engine.sparse.allocation import GREEDY_COST, sparsity_protected_layers
from prunewatch.engine.sparse.calibration import SparsityCalibration, calibrate_sparsity_on_texts

if TYPE_CHECKING:
    from prunewatch.engine.calibration import Calibration
    from prunewatch.engine.execution import InstrumentedModel
    from prunewatch.engine.loading import LoadedModel
    from prunewatch.engine.settings import EngineSettings

logger = logging.getLogger(__name__)


class CalibratedEngine(Protocol):
    """What of a PruningEngine this module reads (not imported: the engine imports this module)."""

    @property
    def settings(self) -> EngineSettings: ...

    @property
    def calibration(self) -> Calibration | None: ...

    @property
    def instrumented(self) -> InstrumentedModel: ...

    @property
    def loaded(self) -> LoadedModel: ...

    def calibration_path(self, corpus_digest: str) -> Path: ...


def sparsity_calibration_path(block_calibration_path: Path, allocation: str, score: str) -> Path:
    """Where the thresholds are cached beside the block calibration; uniform magnitude keeps the old name."""
    kind = "" if (allocation, score) == ("uniform", "magnitude") else f".{allocation}-{score}"
    return block_calibration_path.with_name(f"{block_calibration_path.stem}{kind}.sparsity.json")


def load_or_calibrate_sparsity(engine: CalibratedEngine, texts_by_domain: Mapping[str, Sequence[str]],
                               corpus_digest: str) -> SparsityCalibration:
    """The engine's activation thresholds for its settings' allocation and score: the cached file when it
    was made for this model, score, allocation and protected blocks, else calibrated on the domains'
    texts and cached."""
    settings = engine.settings
    allocation, score = settings.sparsity_allocation, settings.sparsity_score
    protected = sparsity_protected_layers(settings, engine.calibration) if allocation == "greedy" else []
    path = sparsity_calibration_path(engine.calibration_path(corpus_digest), allocation, score)
    if path.is_file():
        cached = SparsityCalibration.load(path)
        if (cached.score == score and cached.allocation_method == allocation
                and (cached.allocation is None or (cached.allocation.protected_layers == protected
                                                   and cached.allocation.cost == GREEDY_COST))):
            return cached
        logger.info("sparsity calibration %s was made for other settings; recalibrating", path)
    texts = [text for domain in sorted(texts_by_domain) for text in texts_by_domain[domain]]
    calibration = calibrate_sparsity_on_texts(
        engine.instrumented, engine.loaded.tokenizer, texts, model_fingerprint=engine.loaded.fingerprint,
        corpus_digest=corpus_digest, score=score, allocation=allocation, protected_layers=protected)
    calibration.save(path)
    return calibration
