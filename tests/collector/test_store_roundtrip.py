"""The store keeps every field of a result, on SQLite and on a real PostgreSQL."""

from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy.orm import Session

from prunewatch.records.store import (
    ResultRepository,
    StoreUnavailableError,
    connect,
    create_schema,
)
from tests.collector.factories import ok_result


def roundtrip(url: str) -> None:
    engine = connect(url)
    create_schema(engine)
    first = ok_result()
    failed = ok_result(status="failed", failure_reason="timeout", error_message="TimeoutError: 5 s", pruning_ratio=None,
                       ratio_source=None, layers_bypassed=None, created_at=first.created_at + timedelta(seconds=1))
    with Session(engine) as session, session.begin():
        repo = ResultRepository(session)
        repo.start_round(round_id=first.round_id, target="embedded", model="probe-llama",
                         started_at=first.created_at, probe_set_digest="d" * 64)
        assert repo.add(first) is True
        assert repo.add(failed) is True
    with Session(engine) as session, session.begin():
        repo = ResultRepository(session)
        assert repo.add(first) is False  # same result_id: idempotent
        assert repo.get(first.result_id) == first
        assert repo.get(failed.result_id) == failed
        assert repo.count() == 2 and repo.count(status="failed") == 1
        assert [r.result_id for r in repo.list(since=first.created_at + timedelta(milliseconds=500))] == [failed.result_id]
        assert repo.list(domain="legal") == []
    engine.dispose()


def test_sqlite_roundtrip(tmp_path):
    roundtrip(f"sqlite:///{tmp_path / 'store.db'}")


@pytest.mark.integration
def test_postgres_roundtrip(postgres):
    roundtrip(postgres.url)


def test_unreachable_database_is_a_one_line_error():
    with pytest.raises(StoreUnavailableError) as info:
        connect("postgresql+psycopg://nobody:secret@127.0.0.1:1/none")
    message = str(info.value)
    assert message.startswith("cannot connect to database postgresql+psycopg://nobody:***@127.0.0.1:1/none")
    assert "secret" not in message and "\n" not in message


def test_invalid_url_is_rejected():
    with pytest.raises(StoreUnavailableError, match="invalid database URL"):
        connect("notadialect://x")


def test_created_at_comes_back_in_utc(tmp_path):
    engine = connect(f"sqlite:///{tmp_path / 'tz.db'}")
    create_schema(engine)
    result = ok_result(created_at=datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC))
    with Session(engine) as session, session.begin():
        ResultRepository(session).start_round(round_id=result.round_id, target="t", model="m",
                                              started_at=result.created_at, probe_set_digest="x")
        ResultRepository(session).add(result)
    with Session(engine) as session:
        assert ResultRepository(session).get(result.result_id).created_at == result.created_at
