"""An on-disk, bounded FIFO of records waiting for the store (a small SQLite file).

Why a file: results are appended here *before* the store sees them, so neither a database outage
nor a killed collector loses one; the next start writes what is left. Why SQLite: each append is
one durable transaction (WAL, synchronous=FULL), reads come back in order, and removing written
records needs no rewrite of the file.

The bound counts results. When it is reached the oldest results are dropped (counted and logged):
an outage longer than the buffer costs the oldest history, while recent results, which alerts and
dashboards need first, are kept. Round markers are small and never dropped, so a kept result
always finds its round.

A buffer belongs to one store: its records are tagged with the store's fingerprint (URL without
password), and opening it for another store while it still holds records is refused.
"""

from __future__ import annotations

import json
import logging
import sqlite3
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from prunewatch.records.results import ProbeResult

logger = logging.getLogger("prunewatch.collector")

KINDS = ("round_start", "result", "round_finish")


class SpoolError(RuntimeError):
    """The buffer file cannot be opened or belongs to another store."""


@dataclass(frozen=True)
class SpoolEntry:
    seq: int
    kind: str
    payload: dict[str, Any]


def result_payload(result: ProbeResult) -> dict[str, Any]:
    values = result.to_dict()
    values["created_at"] = result.created_at.isoformat()
    return values


def result_from_payload(payload: dict[str, Any]) -> ProbeResult:
    values = dict(payload)
    values["created_at"] = datetime.fromisoformat(values["created_at"])
    return ProbeResult(**values)


class DiskSpool:
    """Thread-safe FIFO of (kind, JSON payload) records in one SQLite file."""

    def __init__(self, path: Path | str, *, store_fingerprint: str, max_results: int = 100_000) -> None:
        if max_results < 1:
            raise ValueError(f"max_results must be >= 1, got {max_results}")
        self.path = Path(path)
        self.max_results = max_results
        self.dropped = 0
        self._lock = threading.Lock()
        self._depth: int  # records waiting, and the results among them: counted once here, then kept
        self._results: int
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._db = sqlite3.connect(str(self.path), check_same_thread=False, isolation_level=None)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=FULL")  # an acknowledged append survives a crash
            self._db.execute("CREATE TABLE IF NOT EXISTS entries (seq INTEGER PRIMARY KEY AUTOINCREMENT, "
                             "kind TEXT NOT NULL, payload TEXT NOT NULL)")
            self._db.execute("CREATE TABLE IF NOT EXISTS dead (seq INTEGER PRIMARY KEY, kind TEXT NOT NULL, "
                             "payload TEXT NOT NULL, error TEXT NOT NULL, failed_at TEXT NOT NULL)")
            self._db.execute("CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)")
            self._depth, self._results = self._db.execute(
                "SELECT count(*), coalesce(sum(kind = 'result'), 0) FROM entries").fetchone()
            row = self._db.execute("SELECT value FROM meta WHERE key = 'store'").fetchone()
        except sqlite3.Error as exc:
            raise SpoolError(f"cannot open the buffer file {self.path}: {exc}") from exc
        if row is not None and row[0] != store_fingerprint and self._depth:
            self._db.close()
            raise SpoolError(
                f"buffer file {self.path} holds {self._depth} record(s) for store {row[0]}, not for "
                f"{store_fingerprint}; run the collector against that store to write them, or use another buffer path")
        self._db.execute("INSERT OR REPLACE INTO meta (key, value) VALUES ('store', ?)", (store_fingerprint,))

    def __len__(self) -> int:
        return self._depth

    @property
    def depth(self) -> int:
        """Records waiting (results and round markers)."""
        return self._depth

    @property
    def results_waiting(self) -> int:
        return self._results

    def append(self, kind: str, payload: dict[str, Any]) -> None:
        self.append_many([(kind, payload)])

    def append_many(self, records: Iterable[tuple[str, dict[str, Any]]]) -> None:
        """Append in one durable transaction; makes room by dropping the oldest results if full."""
        rows = []
        for kind, payload in records:
            if kind not in KINDS:
                raise ValueError(f"unknown record kind {kind!r}")
            rows.append((kind, json.dumps(payload, default=str, separators=(",", ":"))))
        if not rows:
            return
        new_results = sum(kind == "result" for kind, _ in rows)
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                overflow = self._results + new_results - self.max_results
                if overflow > 0:
                    self._db.execute("DELETE FROM entries WHERE seq IN (SELECT seq FROM entries WHERE kind = 'result' "
                                     "ORDER BY seq LIMIT ?)", (overflow,))
                self._db.executemany("INSERT INTO entries (kind, payload) VALUES (?, ?)", rows)
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            dropped = max(0, min(overflow, self._results))
            self._results += new_results - dropped
            self._depth += len(rows) - dropped
            self.dropped += dropped
        if dropped:
            logger.error("store buffer full (%d results): dropped the %d oldest result(s)", self.max_results, dropped)

    def peek(self, limit: int) -> list[SpoolEntry]:
        """The oldest `limit` records, in append order."""
        with self._lock:
            rows = self._db.execute("SELECT seq, kind, payload FROM entries ORDER BY seq LIMIT ?", (limit,)).fetchall()
        return [SpoolEntry(seq, kind, json.loads(payload)) for seq, kind, payload in rows]

    def remove(self, entries: list[SpoolEntry]) -> None:
        """Forget records the store has committed."""
        self._delete(entries, None)

    def bury(self, entries: list[SpoolEntry], error: str) -> None:
        """Move records the store rejects for themselves (not for an outage) aside, kept on disk."""
        self._delete(entries, error[:1000])

    def _delete(self, entries: list[SpoolEntry], error: str | None) -> None:
        if not entries:
            return
        seqs = [(e.seq,) for e in entries]
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                if error is not None:
                    now = datetime.now().astimezone().isoformat()
                    self._db.executemany(
                        "INSERT OR REPLACE INTO dead (seq, kind, payload, error, failed_at) "
                        "SELECT seq, kind, payload, ?, ? FROM entries WHERE seq = ?",
                        [(error, now, e.seq) for e in entries])
                removed = self._db.execute(
                    "SELECT count(*), coalesce(sum(kind = 'result'), 0) FROM entries "
                    f"WHERE seq IN ({','.join('?' * len(seqs))})", [s for (s,) in seqs]).fetchone()
                self._db.executemany("DELETE FROM entries WHERE seq = ?", seqs)
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._depth -= removed[0]
            self._results -= removed[1]

    def dead_count(self) -> int:
        with self._lock:
            return int(self._db.execute("SELECT count(*) FROM dead").fetchone()[0])

    def close(self) -> None:
        with self._lock:
            self._db.close()
