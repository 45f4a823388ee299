"""A round interrupted by a crash is closed as aborted at the next start, with the counts it stored."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy.orm import Session

from prunewatch.collector.buffered import BufferedStore
from prunewatch.collector.spool import DiskSpool
from prunewatch.records.store import ResultRepository, connect, create_schema
from tests.collector.factories import ok_result
from tests.collector.prod_helpers import PROBES, count_rows, fresh_database, wait_until
from tests.conftest import REPO_ROOT
from tests.support.servers import free_port

T0 = datetime(2026, 11, 29, 12, 0, tzinfo=UTC)
A, B, C, D = ("a" * 32, "b" * 32, "c" * 32, "d" * 32)


def _rounds(url: str) -> dict[str, tuple]:
    """round_id -> (status, probes_ok, probes_failed, finished_at) as stored."""
    rows = count_rows(url, "SELECT round_id, status, probes_ok, probes_failed, finished_at FROM collector_rounds")
    return {row[0]: tuple(row[1:4]) + (_utc(row[4]),) for row in rows}


def _utc(value) -> datetime | None:
    if isinstance(value, str):  # SQLite read through text(): no type, no zone
        value = datetime.fromisoformat(value)
    if value is not None and value.tzinfo is None:
        value = value.replace(tzinfo=UTC)
    return value


def _result(round_id: str, minutes: float, status: str = "ok", target: str = "t"):
    extra = {"failure_reason": "timeout"} if status != "ok" else {}
    return ok_result(round_id=round_id, target=target, status=status, created_at=T0 + timedelta(minutes=minutes),
                     **extra)


def _start(repo: ResultRepository, round_id: str, target: str, minutes: float) -> None:
    repo.start_round(round_id=round_id, target=target, model="m", started_at=T0 + timedelta(minutes=minutes),
                     probe_set_digest="d")


def check_new_round_closes_the_open_rounds_of_its_target(url: str) -> None:
    engine = connect(url)
    create_schema(engine)
    with Session(engine) as session, session.begin():  # the state a crash leaves: rows written directly
        repo = ResultRepository(session)
        _start(repo, A, "t", 0)  # the crashed round: 2 ok, 1 failed stored, never finished
        repo.add_many([_result(A, 1), _result(A, 2), _result(A, 3, status="failed")])
        _start(repo, B, "other", 0)  # another target's round, open: not this target's business
        _start(repo, C, "t", -10)
        repo.add_many([_result(C, -9)])
        repo.finish_round(C, finished_at=T0 - timedelta(minutes=8), ok=1, failed=0)
    assert {k: v[0] for k, v in _rounds(url).items()} == {A: "running", B: "running", C: "complete"}

    with Session(engine) as session, session.begin():  # the next start's first round of target t
        _start(ResultRepository(session), D, "t", 20)
    rounds = _rounds(url)
    assert rounds[A] == ("aborted", 2, 1, T0 + timedelta(minutes=3))  # its counts, ended at its last result
    assert rounds[B][:3] == ("running", 0, 0) and rounds[B][3] is None
    assert rounds[C] == ("complete", 1, 0, T0 - timedelta(minutes=8))
    assert rounds[D][:3] == ("running", 0, 0)

    with Session(engine) as session, session.begin():
        repo = ResultRepository(session)
        repo.add_many([_result(A, 4)])  # a late result of the aborted round (replayed from a buffer) counts in
        assert repo.abort_open_rounds(target="other") == 1  # a round that stored nothing ends at its start
    rounds = _rounds(url)
    assert rounds[A] == ("aborted", 3, 1, T0 + timedelta(minutes=4))
    assert rounds[B] == ("aborted", 0, 0, T0)

    with Session(engine) as session, session.begin():  # a round closed by mistake is put right by its own end
        ResultRepository(session).finish_round(A, finished_at=T0 + timedelta(minutes=5), ok=3, failed=1)
    assert _rounds(url)[A] == ("complete", 3, 1, T0 + timedelta(minutes=5))
    engine.dispose()


def test_new_round_closes_the_open_rounds_of_its_target_sqlite(tmp_path):
    check_new_round_closes_the_open_rounds_of_its_target(f"sqlite:///{tmp_path / 'store.db'}")


@pytest.mark.integration
def test_new_round_closes_the_open_rounds_of_its_target_postgres(postgres):
    check_new_round_closes_the_open_rounds_of_its_target(fresh_database(postgres))


def test_buffer_replay_in_one_batch_counts_the_aborted_rounds_results(tmp_path):
    """A batch applies round starts before results: the crashed round is closed first, its results counted after."""
    url = f"sqlite:///{tmp_path / 'store.db'}"
    engine = connect(url)
    spool = DiskSpool(tmp_path / "buffer.sqlite", store_fingerprint="db")
    store = BufferedStore(engine, spool)
    store.start_round(round_id=A, target="t", model="m", started_at=T0, probe_set_digest="d")
    store.record(_result(A, 1))
    store.record(_result(A, 2, status="failed"))  # ... then the process died: no round_finish for A
    store.start_round(round_id=B, target="t", model="m", started_at=T0 + timedelta(minutes=5), probe_set_digest="d")
    store.record(_result(B, 6))
    store.finish_round(B, finished_at=T0 + timedelta(minutes=7), ok=1, failed=0)
    assert store.flush_once() == 6 and spool.depth == 0  # one batch, one transaction
    rounds = _rounds(url)
    assert rounds[A] == ("aborted", 1, 1, T0 + timedelta(minutes=2))
    assert rounds[B] == ("complete", 1, 0, T0 + timedelta(minutes=7))
    spool.close()
    engine.dispose()


def _collector(db_url: str, buffer, rounds: int, delay_s: float) -> subprocess.Popen:
    """`prunewatch collect` in a process of its own (tests.collector.prod_helpers.main: fake target, real store)."""
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    return subprocess.Popen([sys.executable, "-m", "tests.collector.prod_helpers", db_url, str(buffer),
                             str(free_port()), str(rounds), str(delay_s)], cwd=REPO_ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _open_round_with_results(path) -> tuple[str, int] | None:
    """(round_id, results stored) of a running round that stored at least two results, read with plain sqlite3."""
    if not path.exists():
        return None
    try:
        with sqlite3.connect(str(path), timeout=5) as db:
            row = db.execute("SELECT r.round_id, COUNT(p.result_id) FROM collector_rounds r JOIN probe_results p "
                             "ON p.round_id = r.round_id WHERE r.status = 'running' GROUP BY r.round_id "
                             "HAVING COUNT(p.result_id) >= 2").fetchone()
    except sqlite3.OperationalError:  # the schema is being created
        return None
    return (row[0], row[1]) if row else None


def test_collector_killed_mid_round_closes_it_as_aborted_at_the_next_start(tmp_path):
    """kill -9 mid-round (no shutdown path runs), restart: the round is aborted with the counts it stored."""
    path = tmp_path / "store.db"
    url = f"sqlite:///{path}"
    buffer = tmp_path / "buffer.sqlite"
    first = _collector(url, buffer, 10_000, 0.4)  # 6 probes of 0.4 s: a round takes 2.4 s
    found: dict = {}
    try:
        wait_until(lambda: found.update(open=_open_round_with_results(path)) or found["open"], 120, 0.05,
                   what="a round with two stored results")
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait(10)
    killed, _stored_then = found["open"]

    second = _collector(url, buffer, 1, 0.0)
    out, _ = second.communicate(timeout=120)
    assert second.returncode == 0, out
    rounds = _rounds(url)
    results = count_rows(url, f"SELECT status, created_at FROM probe_results WHERE round_id = '{killed}'")
    status, ok, failed, finished = rounds[killed]
    assert status == "aborted"
    assert (ok, failed) == (len(results), 0) and 2 <= ok < len(PROBES.probes)  # what it stored, buffered ones too
    assert finished == max(_utc(created) for _, created in results)
    others = [v for k, v in rounds.items() if k != killed]
    assert others and all(v[:3] == ("complete", len(PROBES.probes), 0) for v in others)  # nothing left open
