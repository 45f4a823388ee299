"""Ingest benchmark: how fast results reach PostgreSQL, and how long a /metrics scrape takes at 10k series.

Store (target >= 2,000 results/s, batched):
  - "buffered, end to end": results appended to the on-disk buffer (one durable transaction per
    chunk), then the collector's writer moves them to PostgreSQL in batches (read the buffer,
    idempotent insert, commit, delete from the buffer), timed from first append to empty buffer.
    This is the path every production result takes.
  - "direct, batched": ResultRepository.add_many in one transaction per batch: the database's share.
  - "direct, one per transaction": SqlExporter.record, the embedded collector's path, for comparison.

Scrape (target <= 20 ms): a CollectorMetrics registry filled by record() until its exposition has
at least 10,000 series (sample lines), served exactly as `prunewatch collect` serves it (render
cached until a sample changes, see prunewatch/collector/exposition.py); each scrape is a full HTTP GET of
/metrics, timed by the client. Also reported: a scrape right after each new result (the cache is
re-rendered) and prometheus_client's render alone, so the cache's effect is visible.

    python -m prunewatch.bench.ingest                      # a throwaway PostgreSQL (fsync off), 20,000 results
    python -m prunewatch.bench.ingest --db postgresql+psycopg://user:pw@host/db --results 50000

All figures are measured on this machine; nothing is modelled. The JSON lands in
bench/results/ingest.json with the method next to each number.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
import urllib.request
import uuid
from contextlib import ExitStack
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from pathlib import Path

from prometheus_client import CollectorRegistry, generate_latest
from sqlalchemy.orm import Session

from prunewatch.bench._common import RESULTS_DIR
from prunewatch.collector.buffered import BufferedStore
from prunewatch.collector.exporters import SqlExporter
from prunewatch.collector.exposition import start_metrics_server
from prunewatch.collector.spool import DiskSpool
from prunewatch.records.metrics import CollectorMetrics
from prunewatch.records.results import ProbeResult
from prunewatch.records.store import ResultRepository, connect, create_schema
from prunewatch.services import temporary_postgres

TARGET_RESULTS_PER_S = 2000.0
TARGET_SCRAPE_MS = 20.0
# The throwaway server's settings: as the tests run it, so a commit costs no disk flush and the
# figures show the collector's and the database's work rather than this machine's disk.
THROWAWAY_PG_OPTIONS = {"fsync": "off"}
T0 = datetime(2026, 1, 1, tzinfo=UTC)


def sample_result(i: int, round_id: str, model: str = "probe-llama", domain: str = "tech",
                  probe_id: str = "tech-probe", target: str = "bench") -> ProbeResult:
    """A complete ok result, every column filled as a real probe fills it."""
    return ProbeResult(
        target=target, model=model, probe_id=probe_id, probe_version=1, probe_hash="0123456789abcdef", domain=domain,
        status="ok", round_id=round_id, result_id=uuid.uuid4().hex, created_at=T0 + timedelta(milliseconds=i),
        sensitivity=0.5, pruning_ratio=0.3 + (i % 100) / 1000, ratio_unit="linear_flops", ratio_source="measured",
        executed_flops=123_456_789, dense_flops=176_366_841, layers_bypassed=[2, 3, 5], layers_total=12,
        heads_gated=0, activation_sparsity=0.0, prompt_tokens=40, completion_tokens=64, preprocessing_ms=2.5,
        inference_ms=850.0, postprocessing_ms=40.0, ttft_ms=30.0, tokens_per_s=75.0, decode_tokens_per_s=80.0,
        continuation_agreement=0.98, perplexity_delta_pct=1.2, matched_domain=domain, domain_confidence=0.8,
        fallback_reason=None, peak_memory_bytes=1_000_000, dram_bytes_per_instruction=3.2, dram_source="estimate",
        duration_ms=900.0, output_text="The routing table is shown by ip route show; " * 4)


def _start_round(engine, round_id: str) -> None:
    with Session(engine) as session, session.begin():
        ResultRepository(session).start_round(round_id=round_id, target="bench", model="probe-llama", started_at=T0,
                                              probe_set_digest="0" * 64)


def bench_buffered(engine, n: int, batch_size: int, workdir: Path) -> dict:
    round_id = uuid.uuid4().hex
    spool = DiskSpool(workdir / f"buffer-{round_id}.sqlite", store_fingerprint="bench", max_results=n + 1)
    store = BufferedStore(engine, spool, batch_size=batch_size, migrate=False)
    results = [sample_result(i, round_id) for i in range(n)]
    started = time.perf_counter()
    store.start_round(round_id=round_id, target="bench", model="probe-llama", started_at=T0, probe_set_digest="0" * 64)
    for chunk in range(0, n, batch_size):
        store.record_many(results[chunk:chunk + batch_size])
    appended = time.perf_counter()
    if not store.drain(600):
        raise RuntimeError(f"buffer not drained: {store.last_error}")
    finished = time.perf_counter()
    spool.close()
    return {"results": n, "batch_size": batch_size, "seconds": round(finished - started, 3),
            "append_seconds": round(appended - started, 3), "written": store.written,
            "results_per_s": round(n / (finished - started), 1)}


def bench_direct_batched(engine, n: int, batch_size: int) -> dict:
    round_id = uuid.uuid4().hex
    _start_round(engine, round_id)
    results = [sample_result(i, round_id) for i in range(n)]
    started = time.perf_counter()
    for chunk in range(0, n, batch_size):
        with Session(engine) as session, session.begin():
            ResultRepository(session).add_many(results[chunk:chunk + batch_size])
    seconds = time.perf_counter() - started
    return {"results": n, "batch_size": batch_size, "seconds": round(seconds, 3),
            "results_per_s": round(n / seconds, 1)}


def bench_one_per_transaction(engine, n: int) -> dict:
    round_id = uuid.uuid4().hex
    _start_round(engine, round_id)
    exporter = SqlExporter(engine)
    results = [sample_result(i, round_id) for i in range(n)]
    started = time.perf_counter()
    for result in results:
        exporter.record(result)
    seconds = time.perf_counter() - started
    return {"results": n, "batch_size": 1, "seconds": round(seconds, 3), "results_per_s": round(n / seconds, 1)}


def filled_registry(min_series: int) -> tuple[CollectorMetrics, int, int]:
    """Record results over more and more models until the exposition has >= min_series sample lines."""
    metrics = CollectorMetrics(CollectorRegistry())
    metrics.track_buffer(lambda: 0.0)
    probes = [(domain, f"{domain}-{i}") for domain in ("legal", "tech", "finance") for i in (1, 2)]
    models = 0
    while True:
        for domain, probe_id in probes:
            result = sample_result(models, "r", model=f"model-{models:04d}", domain=domain, probe_id=probe_id,
                                   target=f"target-{models % 20:02d}")
            metrics.record(result)
            metrics.record(replace(result, status="failed", failure_reason="timeout", result_id=uuid.uuid4().hex))
        models += 1
        series = _count_series(generate_latest(metrics.registry))
        if series >= min_series:
            return metrics, series, models


def _count_series(exposition: bytes) -> int:
    return sum(1 for line in exposition.decode().splitlines() if line and not line.startswith("#"))


def _timed_get(url: str, gzip: bool = False) -> tuple[float, int]:
    request = urllib.request.Request(url, headers={"Accept-Encoding": "gzip"} if gzip else {})
    started = time.perf_counter()
    with urllib.request.urlopen(request, timeout=30) as response:
        size = len(response.read())
    return (time.perf_counter() - started) * 1000, size


def _summary(timings: list[float]) -> dict:
    ordered = sorted(timings)
    return {"median_ms": round(statistics.median(ordered), 2),
            "p95_ms": round(ordered[max(0, int(round(0.95 * len(ordered))) - 1)], 2),
            "max_ms": round(ordered[-1], 2)}


def bench_scrape(min_series: int, scrapes: int) -> dict:
    """Steady-state scrapes (cached render), scrapes right after a new result (re-render), raw render time."""
    metrics, series, models = filled_registry(min_series)
    server, thread = start_metrics_server(metrics, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.server_address[1]}/metrics"
    try:
        for _ in range(3):  # warm the server thread and the cache
            _timed_get(url)
        steady, size, gz_size = [], 0, 0
        for _ in range(scrapes):
            took, size = _timed_get(url)
            steady.append(took)
        steady_gzip = []
        for _ in range(scrapes):
            took, gz_size = _timed_get(url, gzip=True)
            steady_gzip.append(took)
        after_change = []
        extra = sample_result(0, "r", model="model-0000", domain="tech", probe_id="tech-1", target="target-00")
        for _ in range(max(5, scrapes // 5)):
            metrics.record(extra)  # a new result changes samples of existing series only
            took, _ = _timed_get(url)
            after_change.append(took)
        renders = []
        for _ in range(max(5, scrapes // 5)):
            started = time.perf_counter()
            generate_latest(metrics.registry)
            renders.append((time.perf_counter() - started) * 1000)
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)
    # start_metrics_server hangs its render cache on the plain ThreadingHTTPServer it returns, so the
    # server's type does not declare it.
    renders_done: int = server.exposition.renders  # type: ignore[attr-defined]
    return {"series": series, "models": models, "bytes": size, "gzip_bytes": gz_size, "scrapes": scrapes,
            "steady": _summary(steady), "steady_gzip": _summary(steady_gzip),
            "after_each_new_result": _summary(after_change), "render_only": _summary(renders),
            "renders": renders_done}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--db", help="PostgreSQL URL (default: start a throwaway local server, fsync off)")
    parser.add_argument("--results", type=int, default=20_000, help="results written per store measurement")
    parser.add_argument("--batch-size", type=int, default=500, help="results per transaction (batched paths)")
    parser.add_argument("--single", type=int, default=1_000, help="results for the one-per-transaction path")
    parser.add_argument("--series", type=int, default=10_000, help="minimum series in the scraped registry")
    parser.add_argument("--scrapes", type=int, default=50, help="timed scrapes")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "ingest.json", help="JSON output")
    args = parser.parse_args(argv)

    with ExitStack() as stack:
        db_url = args.db
        if db_url is None:
            db_url = stack.enter_context(temporary_postgres(options=THROWAWAY_PG_OPTIONS)).url
        engine = connect(db_url)
        create_schema(engine)
        workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="prunewatch-ingest-")))
        with engine.connect() as connection:
            server_version = connection.exec_driver_sql("SHOW server_version").scalar()
        buffered = bench_buffered(engine, args.results, args.batch_size, workdir)
        direct = bench_direct_batched(engine, args.results, args.batch_size)
        single = bench_one_per_transaction(engine, args.single)
        engine.dispose()
    scrape = bench_scrape(args.series, args.scrapes)

    rows = [
        ("results/s to PostgreSQL, buffered end to end", buffered["results_per_s"], f">= {TARGET_RESULTS_PER_S:,.0f}",
         buffered["results_per_s"] >= TARGET_RESULTS_PER_S,
         f"{buffered['results']:,} results, batches of {buffered['batch_size']}"),
        ("results/s to PostgreSQL, direct batched", direct["results_per_s"], f">= {TARGET_RESULTS_PER_S:,.0f}",
         direct["results_per_s"] >= TARGET_RESULTS_PER_S,
         f"{direct['results']:,} results, batches of {direct['batch_size']}"),
        ("results/s, one per transaction (embedded path)", single["results_per_s"], "(reference)", None,
         f"{single['results']:,} results"),
        ("/metrics scrape, median ms", scrape["steady"]["median_ms"], f"<= {TARGET_SCRAPE_MS:g}",
         scrape["steady"]["median_ms"] <= TARGET_SCRAPE_MS,
         f"{scrape['series']:,} series, {scrape['bytes']:,} bytes, {scrape['scrapes']} scrapes"),
        ("/metrics scrape, p95 ms", scrape["steady"]["p95_ms"], f"<= {TARGET_SCRAPE_MS:g}",
         scrape["steady"]["p95_ms"] <= TARGET_SCRAPE_MS, "same, 95th percentile"),
        ("/metrics scrape gzip, median ms", scrape["steady_gzip"]["median_ms"], f"<= {TARGET_SCRAPE_MS:g}",
         scrape["steady_gzip"]["median_ms"] <= TARGET_SCRAPE_MS, f"{scrape['gzip_bytes']:,} bytes on the wire"),
        ("/metrics scrape after a new result, median ms", scrape["after_each_new_result"]["median_ms"], "(reference)",
         None, "worst case: a result recorded before every scrape (re-render)"),
        ("render only (generate_latest), median ms", scrape["render_only"]["median_ms"], "(reference)", None,
         "prometheus_client text format, no HTTP"),
    ]
    width = max(len(r[0]) for r in rows)
    print(f"{'measured':<{width}}  {'value':>10}  {'target':>9}  {'met':>4}  conditions")
    for name, value, target, met, conditions in rows:
        flag = "—" if met is None else ("yes" if met else "NO")
        print(f"{name:<{width}}  {value:>10,.1f}  {target:>9}  {flag:>4}  {conditions}")
    print(f"PostgreSQL {server_version}, Python {platform.python_version()}, {platform.machine()}, "
          f"{__import__('os').cpu_count()} CPU(s); every figure measured in this run")

    record = {
        "measured_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": {"python": platform.python_version(), "machine": platform.machine(),
                    "cpus": __import__("os").cpu_count(), "postgresql": server_version},
        "store": {"buffered_end_to_end": buffered, "direct_batched": direct, "one_per_transaction": single,
                  "target_results_per_s": TARGET_RESULTS_PER_S},
        "scrape": {**scrape, "target_ms": TARGET_SCRAPE_MS},
        "method": {
            "buffered_end_to_end": "wall time from the first append to the on-disk buffer until the writer emptied it "
                                   "into PostgreSQL (idempotent inserts, one transaction per batch)",
            "direct_batched": "ResultRepository.add_many, one transaction per batch",
            "one_per_transaction": "SqlExporter.record per result",
            "store_server": ("the --db server" if args.db else
                             f"a throwaway local PostgreSQL with {THROWAWAY_PG_OPTIONS} (no disk flush per commit)"),
            "scrape": "HTTP GET /metrics against the collector's metrics server (render cached until a sample "
                      "changes), timed by the client after 3 warm-up scrapes; 'after_each_new_result' records a "
                      "result before each scrape, forcing a re-render; 'render_only' times generate_latest alone",
        },
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
