"""DRAM bytes per instruction measured by Nsight Compute, attached to the requests it describes.

ncu must launch the process it profiles and replays every kernel, so it cannot watch a live
request. `profile_dram` therefore measures, once per model and GPU, one decode step of that model
at each activation-sparsity level a deployment uses (dense included) and saves the result as a
profile tied to the model's weights fingerprint and the GPU's name. An engine given the profile
reports, for each request whose steps have the profiled shape (no block bypassed, no head gated), the
measured figure of the level nearest to the request's measured activation sparsity, with
`dram_source="ncu"`. Otherwise (another shape, no level within `MAX_SPARSITY_GAP`, another GPU) the
request keeps the model-level estimate (`"estimate"`).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from prunewatch.engine.errors import CalibrationMismatchError
from prunewatch.engine.ncu import measure_decode_step
from prunewatch.engine.paths import write_text_atomically

DRAM_PROFILE_FORMAT_VERSION = 1
MAX_SPARSITY_GAP = 0.05
"""A request uses a profiled level only when its measured activation sparsity is this close to it."""


@dataclass(frozen=True)
class DramLevel:
    """One profiled decode step."""

    sparsity: float  # activation-sparsity target of the step; 0 is dense
    dram_bytes_read: float
    instructions: float
    kernels: int
    bytes_per_instruction: float


@dataclass(frozen=True)
class DramProfile:
    """ncu measurements of one model on one GPU."""

    model_fingerprint: str
    device_name: str  # torch.cuda.get_device_name() of the profiled GPU
    dtype: str
    batch: int
    levels: list[DramLevel]
    created_at: float = field(default_factory=time.time)
    format_version: int = DRAM_PROFILE_FORMAT_VERSION

    def check(self, fingerprint: str) -> None:
        """Refuse a profile made for another model; callers treat another GPU as 'no profile'."""
        if fingerprint != self.model_fingerprint:
            raise CalibrationMismatchError(
                f"DRAM profile was measured on model {self.model_fingerprint[:12]}, not on this model "
                f"({fingerprint[:12]}); run `prunewatch profile-dram` for it")

    def matches_device(self, device_name: str) -> bool:
        return device_name == self.device_name

    def level_for(self, activation_sparsity: float) -> DramLevel | None:
        """The profiled level nearest to a request's measured sparsity, if within MAX_SPARSITY_GAP."""
        if not self.levels:
            return None
        nearest = min(self.levels, key=lambda level: abs(level.sparsity - activation_sparsity))
        return nearest if abs(nearest.sparsity - activation_sparsity) <= MAX_SPARSITY_GAP else None

    def save(self, path: Path) -> None:
        write_text_atomically(path, json.dumps(asdict(self), indent=1) + "\n")  # readers never see half a profile

    @classmethod
    def load(cls, path: Path) -> DramProfile:
        try:
            raw = json.loads(Path(path).read_text())
        except (OSError, ValueError) as exc:
            raise CalibrationMismatchError(f"cannot read DRAM profile {path}: {exc}") from exc
        if raw.get("format_version") != DRAM_PROFILE_FORMAT_VERSION:
            raise CalibrationMismatchError(
                f"DRAM profile {path} has format {raw.get('format_version')}, expected "
                f"{DRAM_PROFILE_FORMAT_VERSION}; run `prunewatch profile-dram` again")
        raw["levels"] = [DramLevel(**level) for level in raw["levels"]]
        return cls(**raw)


def profile_dram(
    model_dir: Path,
    *,
    model_fingerprint: str,
    device_name: str,
    sparsities: Sequence[float] = (0.0, 0.5),
    dtype: str = "bfloat16",
    batch: int = 1,
    ncu: str | None = None,
    timeout_s: float = 600.0,
    progress: Callable[[int, int], None] | None = None,
) -> DramProfile:
    """Measure one decode step of the model under ncu at each sparsity level (prunewatch.engine.ncu)."""
    if not sparsities or any(not 0.0 <= s < 1.0 for s in sparsities):
        raise ValueError(f"sparsity levels must be in [0, 1), got {list(sparsities)}")
    wanted = sorted(set(sparsities))
    levels = []
    for index, sparsity in enumerate(wanted):
        measured = measure_decode_step(sparsity=sparsity, batch=batch, dtype=dtype, model_dir=model_dir, ncu=ncu,
                                       timeout_s=timeout_s).to_dict()
        del measured["source"]  # every level of a profile is measured by ncu
        levels.append(DramLevel(sparsity=sparsity, **measured))
        if progress is not None:
            progress(index + 1, len(wanted))
    return DramProfile(model_fingerprint=model_fingerprint, device_name=device_name, dtype=dtype, batch=batch,
                       levels=levels)
