"""The disk buffer and the buffered store: durable, bounded, ordered, idempotent on replay."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime, timedelta

import pytest
from prometheus_client import CollectorRegistry
from sqlalchemy.orm import Session

from prunewatch.collector.buffered import Backoff, BufferedStore
from prunewatch.collector.spool import DiskSpool, SpoolError, result_from_payload, result_payload
from prunewatch.records.metrics import CollectorMetrics
from prunewatch.records.store import ResultRepository, connect, create_schema
from tests.collector.factories import ok_result

T0 = datetime(2026, 11, 29, 12, 0, tzinfo=UTC)


def results(n: int, round_id: str = "a" * 32):
    return [ok_result(round_id=round_id, result_id=f"{i:032x}", created_at=T0 + timedelta(seconds=i)) for i in range(n)]


def test_payload_roundtrip_keeps_every_field():
    result = ok_result()
    assert result_from_payload(result_payload(result)) == result


def test_spool_survives_reopen_in_order_and_removes_exactly(tmp_path):
    path = tmp_path / "buffer.sqlite"
    spool = DiskSpool(path, store_fingerprint="db-a")
    spool.append("round_start", {"round_id": "r1"})
    spool.append_many([("result", {"result_id": str(i)}) for i in range(3)])
    spool.close()  # as a restart would
    spool = DiskSpool(path, store_fingerprint="db-a")
    assert (spool.depth, spool.results_waiting) == (4, 3)
    entries = spool.peek(10)
    assert [(e.kind, e.payload) for e in entries] == [("round_start", {"round_id": "r1"})] + [
        ("result", {"result_id": str(i)}) for i in range(3)]
    spool.remove(entries[:2])
    assert [e.payload for e in spool.peek(10)] == [{"result_id": "1"}, {"result_id": "2"}]
    assert (spool.depth, spool.results_waiting) == (2, 2)
    with pytest.raises(ValueError, match="unknown record kind"):
        spool.append("note", {})


def test_full_spool_drops_oldest_results_never_round_markers(tmp_path):
    spool = DiskSpool(tmp_path / "b.sqlite", store_fingerprint="db", max_results=3)
    spool.append("round_start", {"round_id": "r"})
    for i in range(5):
        spool.append("result", {"result_id": str(i)})
    assert spool.dropped == 2
    assert [(e.kind, e.payload) for e in spool.peek(10)] == [
        ("round_start", {"round_id": "r"}), ("result", {"result_id": "2"}), ("result", {"result_id": "3"}),
        ("result", {"result_id": "4"})]
    assert (spool.depth, spool.results_waiting) == (4, 3)


def test_spool_of_another_store_is_refused_while_it_holds_records(tmp_path):
    path = tmp_path / "b.sqlite"
    spool = DiskSpool(path, store_fingerprint="postgresql+psycopg://u:***@a/db")
    spool.append("result", {"result_id": "1"})
    spool.close()
    with pytest.raises(SpoolError, match=r"holds 1 record\(s\) for store postgresql\+psycopg://u:\*\*\*@a/db, "
                                         r"not for sqlite:///other.db"):
        DiskSpool(path, store_fingerprint="sqlite:///other.db")
    spool = DiskSpool(path, store_fingerprint="postgresql+psycopg://u:***@a/db")
    spool.remove(spool.peek(1))
    spool.close()
    DiskSpool(path, store_fingerprint="sqlite:///other.db").close()  # empty: free to move on


def store(tmp_path, name="store.db"):
    engine = connect(f"sqlite:///{tmp_path / name}")
    create_schema(engine)
    return engine


def rows(engine):
    with Session(engine) as session:
        repo = ResultRepository(session)
        return [r.result_id for r in repo.list()], repo.round_count()


def test_replaying_a_committed_batch_writes_nothing_twice(tmp_path):
    """A crash between the store's commit and the buffer's removal replays the batch: no duplicate, no error."""
    engine = store(tmp_path)
    spool = DiskSpool(tmp_path / "b.sqlite", store_fingerprint="s")
    writer = BufferedStore(engine, spool, batch_size=4)
    writer.start_round(round_id="a" * 32, target="embedded", model="probe-llama", started_at=T0, probe_set_digest="d")
    for result in results(6):
        writer.record(result)
    writer.finish_round("a" * 32, finished_at=T0 + timedelta(minutes=1), ok=6, failed=0)

    def crash(_entries):
        raise KeyboardInterrupt("killed after commit")

    spool.remove = crash  # the first batch commits, then the process "dies"
    with pytest.raises(KeyboardInterrupt):
        writer.flush_once()
    assert rows(engine) == ([f"{i:032x}" for i in range(3)], 1)
    spool.close()

    spool = DiskSpool(tmp_path / "b.sqlite", store_fingerprint="s")  # the restart
    assert spool.depth == 8
    restarted = BufferedStore(engine, spool, batch_size=4)
    assert restarted.drain(10) is True
    assert rows(engine) == ([f"{i:032x}" for i in range(6)], 1)
    assert restarted.written == 3  # the 3 replayed results were skipped, not inserted again
    with Session(engine) as session:
        from prunewatch.records.store.models import RoundRow

        round_row = session.get(RoundRow, "a" * 32)
        assert (round_row.probes_ok, round_row.probes_failed) == (6, 0)


def test_a_record_the_store_rejects_goes_to_dead_letters_and_the_rest_is_written(tmp_path):
    engine = store(tmp_path)
    spool = DiskSpool(tmp_path / "b.sqlite", store_fingerprint="s")
    metrics = CollectorMetrics(CollectorRegistry())
    writer = BufferedStore(engine, spool, metrics=metrics, batch_size=10)
    writer.start_round(round_id="a" * 32, target="t", model="m", started_at=T0, probe_set_digest="d")
    good = results(2)
    orphan = replace(good[0], result_id="f" * 32, round_id="b" * 32)  # its round was never recorded: FK error
    for result in (good[0], orphan, good[1]):
        writer.record(result)
    assert writer.drain(10) is True
    assert rows(engine) == ([good[0].result_id, good[1].result_id], 1)
    assert spool.dead_count() == 1 and spool.depth == 0
    assert metrics.registry.get_sample_value("prunewatch_collector_store_write_errors_total",
                                             {"kind": "rejected"}) == 1.0


def test_background_writer_with_an_unreachable_store_keeps_records_and_exposes_depth(tmp_path):
    engine = connect("postgresql+psycopg://u:p@127.0.0.1:9/none", check=False)  # port 9: nothing listens
    spool = DiskSpool(tmp_path / "b.sqlite", store_fingerprint="s")
    metrics = CollectorMetrics(CollectorRegistry())
    writer = BufferedStore(engine, spool, metrics=metrics, backoff=Backoff(0.05, 0.1))
    writer.start()
    writer.start_round(round_id="a" * 32, target="t", model="m", started_at=T0, probe_set_digest="d")
    for result in results(3):
        writer.record(result)
    assert writer.close(timeout_s=0.5) is False
    assert metrics.registry.get_sample_value("prunewatch_collector_buffer_depth") == 4.0
    assert metrics.registry.get_sample_value("prunewatch_collector_store_write_errors_total",
                                             {"kind": "unavailable"}) >= 1
    assert writer.last_error.startswith("cannot migrate the schema: connection failed: connection to server at")
    assert spool.depth == 4  # left on disk for the next start


def test_backoff_doubles_up_to_its_cap_with_bounded_jitter():
    backoff = Backoff(0.5, 4.0)
    for attempt, base in [(0, 0.5), (1, 1.0), (2, 2.0), (3, 4.0), (10, 4.0)]:
        delays = [backoff.delay(attempt) for _ in range(50)]
        assert all(0.8 * base <= d <= 1.2 * base for d in delays)
