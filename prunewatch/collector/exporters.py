"""Exporters: each turns a ProbeResult into one kind of record (SQL row, log line, ...).

The collector hands every result to every exporter; one exporter failing never stops another,
and never loses the result for the others.
"""

from __future__ import annotations

import json
import logging
from datetime import datetime
from typing import Protocol

from sqlalchemy import Engine
from sqlalchemy.orm import Session

from prunewatch.records.results import ProbeResult
from prunewatch.records.store.repository import ResultRepository

logger = logging.getLogger("prunewatch.collector")


class Exporter(Protocol):
    def record(self, result: ProbeResult) -> None: ...


class RoundExporter(Exporter, Protocol):
    """An exporter that also records each round's start and end (the store's exporters)."""

    def start_round(self, *, round_id: str, target: str, model: str, started_at: datetime,
                    probe_set_digest: str) -> None: ...

    def finish_round(self, round_id: str, *, finished_at: datetime, ok: int, failed: int) -> None: ...


class SqlExporter:
    """Writes each result in its own transaction: a crash mid-round never leaves half a row."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def start_round(self, *, round_id: str, target: str, model: str, started_at: datetime, probe_set_digest: str) -> None:
        with Session(self.engine) as session, session.begin():
            ResultRepository(session).start_round(round_id=round_id, target=target, model=model,
                                                  started_at=started_at, probe_set_digest=probe_set_digest)

    def finish_round(self, round_id: str, *, finished_at: datetime, ok: int, failed: int) -> None:
        with Session(self.engine) as session, session.begin():
            ResultRepository(session).finish_round(round_id, finished_at=finished_at, ok=ok, failed=failed)

    def record(self, result: ProbeResult) -> None:
        with Session(self.engine) as session, session.begin():
            ResultRepository(session).add(result)


class LogExporter:
    """One structured (JSON) log line per probe."""

    def record(self, result: ProbeResult) -> None:
        fields = {k: v for k, v in result.to_dict().items() if k != "output_text" and v is not None}
        fields["created_at"] = result.created_at.isoformat()
        logger.info("probe_result %s", json.dumps(fields, sort_keys=True, default=str))
