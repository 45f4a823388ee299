"""Read probe results for a window from the collector's store (the ROI part's only I/O)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from sqlalchemy import Engine, inspect
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session

from prunewatch.records.results import ProbeResult
from prunewatch.records.store import ResultRepository, StoreUnavailableError, connect_existing
from prunewatch.roi.errors import RoiStoreError
from prunewatch.roi.measured import Window


@contextmanager
def _store_with_results(url: str) -> Iterator[Engine]:
    """An Engine on a store that exists and has a results table; RoiStoreError otherwise."""
    try:
        engine = connect_existing(url)
    except StoreUnavailableError as exc:
        raise RoiStoreError(str(exc)) from exc
    try:
        if not inspect(engine).has_table("probe_results"):
            raise RoiStoreError("the store has no probe results table yet; run the collector (`prunewatch run`) first")
        yield engine
    except SQLAlchemyError as exc:
        raise RoiStoreError(f"cannot read the store: {str(exc).splitlines()[0]}") from exc
    finally:
        engine.dispose()


def check_store(url: str) -> None:
    """Fail early with a RoiStoreError when the store is missing, unreachable or has no results table."""
    with _store_with_results(url):
        pass


def load_results(url: str, window: Window, target: str | None = None) -> list[ProbeResult]:
    """Every probe result in the window (optionally one target's), oldest first."""
    with _store_with_results(url) as engine, Session(engine) as session:
        return ResultRepository(session).list(since=window.start, until=window.end, target=target)
