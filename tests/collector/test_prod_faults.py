"""Nothing is lost: a PostgreSQL outage mid-run, and a collector killed mid-round, cost no result and duplicate none."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import urllib.request
from collections import Counter

import psycopg
import pytest

from prunewatch.collector.fleet import FleetSettings, run_collector
from prunewatch.collector.scheduler import TargetJob
from prunewatch.records.metrics import CollectorMetrics
from tests.collector.prod_helpers import (
    PROBES,
    FakeTarget,
    count_rows,
    fresh_database,
    spool_result_ids,
    wait_until,
)
from tests.conftest import REPO_ROOT
from tests.support.servers import free_port, postgres_available, postgres_server

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(not postgres_available(), reason="PostgreSQL server binaries not installed")]

PROBE_ORDER = [p.id for p in PROBES.probes]


@pytest.fixture(scope="module")
def pg_server():
    """A PostgreSQL of this module's own: the tests stop and restart it (the session's server stays up)."""
    with postgres_server() as server:
        yield server


@pytest.fixture
def stoppable_pg(pg_server):
    """The module's server, running at the start of each test even if an earlier test failed while it was down."""
    try:
        psycopg.connect(host=pg_server.host, port=pg_server.port, user=pg_server.user, password=pg_server.password,
                        dbname=pg_server.database, connect_timeout=3).close()
    except psycopg.OperationalError:
        pg_server.start()
    return pg_server


def metric_value(port: int, name: str) -> float | None:
    """The sum of a family's samples on the collector's /metrics, scraped over HTTP as Prometheus would."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
            body = response.read().decode()
    except OSError:
        return None
    values = [float(line.rsplit(" ", 1)[1]) for line in body.splitlines()
              if line.split(" ")[0].split("{")[0] == name]
    return sum(values) if values else None


def test_postgres_outage_mid_run_every_result_stored_exactly_once(tmp_path, stoppable_pg):
    pg = stoppable_pg
    url = fresh_database(pg)
    port = free_port()
    settings = FleetSettings(db_url=url, buffer_path=tmp_path / "buffer.sqlite", rounds=6, metrics_port=port,
                             backoff_initial_s=0.1, backoff_max_s=0.4, drain_timeout_s=60)
    metrics = CollectorMetrics()
    summaries = []
    seen: dict[str, float | None] = {}

    def on_round(summary):
        summaries.append(summary)
        if len(summaries) == 2:
            pg.stop()  # rounds 3 and 4 run while the database is down
        elif len(summaries) == 4:
            # Probing went on and /metrics kept answering; the store writes failed and were retried.
            seen["results"] = metric_value(port, "prunewatch_probe_results_total")
            seen["depth"] = metric_value(port, "prunewatch_collector_buffer_depth")
            seen["errors"] = metrics.registry.get_sample_value(
                "prunewatch_collector_store_write_errors_total", {"kind": "unavailable"})
            pg.start()

    outcome = run_collector(settings, [TargetJob(FakeTarget(delay_s=0.01), PROBES, interval_s=0.5)],
                            on_round=on_round, metrics=metrics)

    stored = count_rows(url, "SELECT result_id, round_id, probe_id FROM probe_results")
    rounds = count_rows(url, "SELECT round_id, probes_ok, probes_failed, finished_at IS NOT NULL "
                             "FROM collector_rounds")

    produced = [r.result_id for s in summaries for r in s.results]
    assert len(summaries) == 6 and len(produced) == 36 and outcome.results == 36
    assert sorted(row[0] for row in stored) == sorted(produced)  # every result, none twice
    assert max(Counter((row[1], row[2]) for row in stored).values()) == 1
    assert sorted(rounds) == sorted((s.round_id, 6, 0, True) for s in summaries)
    assert outcome.buffered == 0 and outcome.written == 36
    assert seen["results"] == 24.0  # rounds 1-4, all exposed although 3 and 4 were not in the store yet
    assert seen["depth"] is not None and seen["depth"] >= 12  # at least rounds 3 and 4 waited on disk
    assert seen["errors"] is not None and seen["errors"] >= 1


def _collector(db_url: str, buffer, port: int, rounds: int, delay_s: float) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    return subprocess.Popen([sys.executable, "-m", "tests.collector.prod_helpers", db_url, str(buffer), str(port),
                             str(rounds), str(delay_s)], cwd=REPO_ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_collector_killed_mid_round_restart_writes_buffered_results_once(tmp_path, stoppable_pg):
    pg = stoppable_pg
    url = fresh_database(pg)
    buffer = tmp_path / "buffer.sqlite"
    port = free_port()
    first = _collector(url, buffer, port, 10_000, 0.05)
    try:
        # Some results reach the store directly; then the store goes down and results pile up on disk.
        wait_until(lambda: (metric_value(port, "prunewatch_probe_results_total") or 0) >= 8, 120,
                   what="first results")
        pg.stop()
        wait_until(lambda: (metric_value(port, "prunewatch_collector_buffer_depth") or 0) >= 9, 60,
                   what="buffered results")
    finally:
        first.send_signal(signal.SIGKILL)  # no shutdown path runs: no drain, no flush
        first.wait(10)
    buffered = spool_result_ids(buffer)
    assert len(buffered) >= 7

    pg.start()
    second = _collector(url, buffer, free_port(), 1, 0.0)
    out, _ = second.communicate(timeout=120)
    assert second.returncode == 0, out
    assert "buffered=0" in out
    stored = count_rows(url, "SELECT result_id, round_id, probe_id FROM probe_results")
    rounds = count_rows(url, "SELECT round_id, probes_ok FROM collector_rounds")

    assert spool_result_ids(buffer) == []
    ids = [row[0] for row in stored]
    assert len(ids) == len(set(ids)) and set(buffered) <= set(ids)  # every buffered result, none twice
    by_round: dict[str, list[str]] = {}
    for _, round_id, probe_id in stored:
        by_round.setdefault(round_id, []).append(probe_id)
    # Within a round, probes run in file order: each round holds a prefix of it with no gap (nothing lost in
    # the middle), complete for every round except the one the kill interrupted.
    partial = 0
    for round_id, probe_ids in by_round.items():
        assert sorted(probe_ids, key=PROBE_ORDER.index) == PROBE_ORDER[:len(probe_ids)], round_id
        partial += len(probe_ids) < len(PROBE_ORDER)
    assert partial <= 1
    assert {r for r, _ in rounds} >= set(by_round)  # every result's round was recorded
    assert max(Counter((row[1], row[2]) for row in stored).values()) == 1
