"""Fixtures of the alerting tests: a fresh SQLite store, a local Slack receiver, result factories."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import pytest
from sqlalchemy import Engine
from sqlalchemy.orm import Session

from prunewatch.records.results import ProbeResult
from prunewatch.records.store import ResultRepository, connect, create_schema
from tests.alerts.slack_receiver import SlackReceiver

T0 = datetime(2026, 3, 2, 9, 0, 0, tzinfo=UTC)


def result(at: datetime, domain: str, probe: str, *, ratio: float | None = 0.3, agreement: float | None = 0.9,
           inference_ms: float | None = 400.0, status: str = "ok", reason: str | None = None,
           model: str = "probe-llama") -> ProbeResult:
    """A stored probe result with the fields the rules read; everything else left unmeasured."""
    ok = status == "ok"
    return ProbeResult(target="embedded", model=model, probe_id=probe, probe_version=1, probe_hash="0" * 16,
                       domain=domain, status=status, round_id="r" * 32, created_at=at,
                       pruning_ratio=ratio if ok else None, continuation_agreement=agreement if ok else None,
                       inference_ms=inference_ms if ok else None, failure_reason=None if ok else reason)


def store_results(engine: Engine, results: list[ProbeResult]) -> None:
    with Session(engine) as session, session.begin():
        repo = ResultRepository(session)
        for round_id in {r.round_id for r in results}:
            repo.start_round(round_id=round_id, target="embedded", model="probe-llama",
                             started_at=min(r.created_at for r in results), probe_set_digest="0" * 64)
        for r in results:
            repo.add(r)


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Engine]:
    engine = connect(f"sqlite:///{tmp_path / 'store.db'}")
    create_schema(engine)
    yield engine
    engine.dispose()


@pytest.fixture
def receiver() -> Iterator[SlackReceiver]:
    slack = SlackReceiver().start()
    yield slack
    slack.stop()
