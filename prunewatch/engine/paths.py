"""The one place that says where prunewatch keeps its per-user caches (models, calibrations, kernels)."""

from __future__ import annotations

import os
import threading
from pathlib import Path


def cache_root() -> Path:
    """`$XDG_CACHE_HOME/prunewatch`, else `~/.cache/prunewatch`: every cache folder lives below it."""
    base = os.environ.get("XDG_CACHE_HOME")
    return (Path(base).expanduser() if base else Path.home() / ".cache") / "prunewatch"


def calibration_cache() -> Path:
    """Default folder of cached calibrations (block influence and activation thresholds)."""
    return cache_root() / "calibration"


def write_text_atomically(path: Path, text: str) -> None:
    """Write `path` so that readers only ever see a whole file: through a temporary file named by process and
    thread (two writers of one cache entry, a server and a collector or two test workers, never write into each
    other's), then an atomic rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        tmp.write_text(text)
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)
