"""The store exporter that loses nothing: write-ahead to a disk buffer, then batched, idempotent writes.

Every record (round start, probe result, round end) is appended to the `DiskSpool` first; a writer
thread moves the oldest records to the database in batches, one transaction per batch, and only
then removes them from the buffer. So:

- the database being down costs nothing but delay: the writer retries with exponential backoff
  (plus jitter) and the buffer grows, visible as `prunewatch_collector_buffer_depth`;
- a collector killed at any point loses nothing: the next start writes what the buffer holds;
- nothing is written twice: results are inserted with "on conflict do nothing" on `result_id`,
  rounds likewise on `round_id`, and a round's end is an idempotent update, so replaying a batch
  whose commit was acknowledged but not yet removed from the buffer changes nothing.

A record the database refuses for itself (an integrity or data error, not an outage) is moved to
the buffer's dead-letter table so it cannot block the records behind it.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import Engine
from sqlalchemy.exc import DataError, IntegrityError, ProgrammingError, SQLAlchemyError
from sqlalchemy.orm import Session

from prunewatch.collector.spool import DiskSpool, SpoolEntry, result_from_payload, result_payload
from prunewatch.records.metrics import CollectorMetrics
from prunewatch.records.results import ProbeResult
from prunewatch.records.store.database import StoreUnavailableError, reason
from prunewatch.records.store.migrate import upgrade
from prunewatch.records.store.repository import ResultRepository

logger = logging.getLogger("prunewatch.collector")


@dataclass(frozen=True)
class Backoff:
    """Exponential backoff between failed write attempts: initial, x2 each time, capped, +-20% jitter."""

    initial_s: float = 0.5
    max_s: float = 30.0

    def delay(self, attempt: int) -> float:
        base = min(self.max_s, self.initial_s * (2.0 ** min(attempt, 30)))
        return base * random.uniform(0.8, 1.2)


class BufferedStore:
    """Exporter: `record`, `start_round`, `finish_round` append to the buffer and return at once."""

    def __init__(self, engine: Engine, spool: DiskSpool, *, metrics: CollectorMetrics | None = None,
                 batch_size: int = 500, backoff: Backoff = Backoff(), migrate: bool = True,
                 idle_poll_s: float = 1.0) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.engine = engine
        self.spool = spool
        self.metrics = metrics
        self.batch_size = batch_size
        self.backoff = backoff
        self.idle_poll_s = idle_poll_s
        self._schema_ready = not migrate
        self._wake = threading.Event()
        self._closing = threading.Event()
        self._deadline = float("inf")
        self._thread: threading.Thread | None = None
        self._flush_lock = threading.Lock()
        self.written = 0
        self.failed_attempts = 0
        self.last_error: str | None = None
        self._dropped_seen = spool.dropped
        if metrics is not None:
            metrics.track_buffer(lambda: float(self.spool.depth))

    # -- exporter surface (called from probe threads) -----------------------------------------
    def start_round(self, *, round_id: str, target: str, model: str, started_at: datetime,
                    probe_set_digest: str) -> None:
        self._append("round_start", dict(round_id=round_id, target=target, model=model,
                                         started_at=started_at.isoformat(), probe_set_digest=probe_set_digest))

    def finish_round(self, round_id: str, *, finished_at: datetime, ok: int, failed: int) -> None:
        self._append("round_finish", dict(round_id=round_id, finished_at=finished_at.isoformat(), ok=ok,
                                          failed=failed))

    def record(self, result: ProbeResult) -> None:
        self._append("result", result_payload(result))

    def record_many(self, results: Sequence[ProbeResult]) -> None:
        """Append many results in one buffer transaction (bulk loads and the ingest benchmark)."""
        self.spool.append_many([("result", result_payload(r)) for r in results])
        self._after_append()

    def _append(self, kind: str, payload: dict[str, Any]) -> None:
        self.spool.append(kind, payload)
        self._after_append()

    def _after_append(self) -> None:
        if self.metrics is not None:
            self.metrics.count_dropped(self.spool.dropped - self._dropped_seen)
        self._dropped_seen = self.spool.dropped
        self._wake.set()

    # -- writing -------------------------------------------------------------------------------
    def flush_once(self) -> int:
        """Write the oldest batch; returns records taken off the buffer. Raises when the store is down."""
        with self._flush_lock:
            entries = self.spool.peek(self.batch_size)
            if not entries:
                return 0
            if not self._schema_ready:
                upgrade(self.engine)
                self._schema_ready = True
            try:
                with Session(self.engine) as session, session.begin():
                    inserted = _apply(ResultRepository(session), entries)
            except (IntegrityError, DataError):
                inserted = self._apply_one_by_one(entries)
            except ProgrammingError:
                self._schema_ready = False  # e.g. the schema was dropped under us: migrate again, then retry
                raise
            self.spool.remove(entries)
            self.written += inserted
            return len(entries)

    def _apply_one_by_one(self, entries: list[SpoolEntry]) -> int:
        inserted = 0
        for entry in entries:
            try:
                with Session(self.engine) as session, session.begin():
                    inserted += _apply(ResultRepository(session), [entry])
            except (IntegrityError, DataError) as exc:
                logger.error("store rejected buffered %s %s: %s; moved to the buffer's dead letters",
                             entry.kind, entry.payload.get("result_id") or entry.payload.get("round_id"),
                             reason(exc)[:300])
                self.spool.bury([entry], reason(exc)[:300])
                if self.metrics is not None:
                    self.metrics.count_store_error("rejected")
        return inserted

    def drain(self, timeout_s: float) -> bool:
        """Write until the buffer is empty (True) or the time is up (False); used at shutdown and in tools."""
        deadline = time.monotonic() + timeout_s
        attempt = 0
        while self.spool.depth:
            try:
                self.flush_once()
                attempt = 0
            except (SQLAlchemyError, StoreUnavailableError) as exc:
                self._note_failure(exc)
                pause = min(self.backoff.delay(attempt), deadline - time.monotonic())
                attempt += 1
                if pause <= 0:
                    return False
                time.sleep(pause)
            if time.monotonic() >= deadline and self.spool.depth:
                return False
        return True

    def _note_failure(self, exc: BaseException) -> None:
        self.failed_attempts += 1
        message = reason(exc)[:300]
        if message != self.last_error:  # one warning per distinct problem, not one per retry
            logger.warning("store unavailable, %d record(s) buffered on disk; retrying with backoff: %s",
                           self.spool.depth, message)
        self.last_error = message
        if self.metrics is not None:
            self.metrics.count_store_error("unavailable")

    # -- background writer ----------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="prunewatch-store-writer", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        attempt = 0
        while True:
            if self._closing.is_set() and (not self.spool.depth or time.monotonic() >= self._deadline):
                return
            if not self.spool.depth:
                self._wake.wait(self.idle_poll_s)
                self._wake.clear()
                continue
            try:
                self.flush_once()
                if attempt:
                    logger.warning("store reachable again; writing the buffered records")
                    self.last_error = None
                attempt = 0
            except (SQLAlchemyError, StoreUnavailableError) as exc:
                self._note_failure(exc)
                pause = self.backoff.delay(attempt)
                attempt += 1
                if self._closing.is_set():  # final drain: never wait past the deadline
                    time.sleep(min(pause, max(0.0, self._deadline - time.monotonic())))
                else:
                    self._closing.wait(pause)  # close() cuts the pause short and starts the final drain
            except Exception:  # never let the writer die: log, back off, try again
                logger.exception("unexpected error while writing buffered records")
                time.sleep(self.backoff.delay(attempt))
                attempt += 1

    def close(self, timeout_s: float = 10.0) -> bool:
        """Write what is buffered for up to timeout_s, stop the writer; True when nothing is left.

        Whatever is left stays in the buffer file and is written by the next start.
        """
        self._deadline = time.monotonic() + timeout_s
        self._closing.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout_s + 5.0)
            self._thread = None
        else:
            self.drain(timeout_s)
        left = self.spool.depth
        if left:
            logger.warning("%d record(s) left in the buffer %s; the next start writes them", left, self.spool.path)
        return left == 0


def _apply(repository: ResultRepository, entries: list[SpoolEntry]) -> int:
    """One batch inside the caller's transaction: rounds first (results reference them), then results, then ends."""
    starts = [dict(e.payload, started_at=datetime.fromisoformat(e.payload["started_at"]))
              for e in entries if e.kind == "round_start"]
    results = [result_from_payload(e.payload) for e in entries if e.kind == "result"]
    repository.start_rounds(starts)
    inserted = repository.add_many(results)
    for e in entries:
        if e.kind == "round_finish":
            repository.finish_round(e.payload["round_id"], finished_at=datetime.fromisoformat(e.payload["finished_at"]),
                                    ok=int(e.payload["ok"]), failed=int(e.payload["failed"]))
    return inserted
