"""Helpers of the production-collector tests: a fast deterministic target, fresh PostgreSQL databases."""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import psycopg
from sqlalchemy import text

from prunewatch.engine.stats import GenerationResult, RequestStats
from prunewatch.probes import Probe, ProbeSet
from prunewatch.records.store import connect
from prunewatch.services import PUSHGATEWAY_BINARIES, find_binary, free_port, launch, stop, wait_for_http, which_binary

PROBES = ProbeSet(tuple(
    Probe(id=f"{domain}-{i}", domain=domain, version=1, max_tokens=4, system="", prompt=f"{domain} question {i}")
    for domain in ("legal", "tech", "finance") for i in (1, 2)), source="prod-tests")


class FakeTarget:
    """A deterministic Target: answers each probe after `delay_s` with figures derived from the probe id.

    Used where a test is about the store and the buffer (which stay real), so a round takes
    milliseconds instead of a model's seconds.
    """

    def __init__(self, name: str = "fake", model: str = "fake-model", delay_s: float = 0.0,
                 slow: dict[str, float] | None = None) -> None:
        self.name = name
        self.model = model
        self.delay_s = delay_s
        self.slow = slow or {}
        self.calls = 0
        self.finished = 0
        self._lock = threading.Lock()

    def run_probe(self, probe: Probe) -> GenerationResult:
        with self._lock:
            self.calls += 1
        time.sleep(self.slow.get(probe.id, self.delay_s))
        index = int(probe.id.rsplit("-", 1)[1])
        stats = RequestStats(
            request_id=uuid.uuid4().hex, model=self.model, device="cpu", dtype="float32", prompt_tokens=5,
            completion_tokens=4, preprocessing_ms=1.0, inference_ms=100.0 * index, postprocessing_ms=2.0,
            ttft_ms=30.0, decode_tokens_per_s=40.0, tokens_per_s=40.0, sensitivity=0.5,
            pruning_ratio=0.25 * index, executed_flops=100 - 25 * index, dense_flops=100, domain=probe.domain)
        with self._lock:
            self.finished += 1
        return GenerationResult(text=f"answer {probe.id}", token_ids=[1, 2, 3, 4], stats=stats)


def fresh_database(server) -> str:
    """A new, empty database on `server` (a tests.support PostgresServer); returns its SQLAlchemy URL."""
    name = f"t_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(host=server.host, port=server.port, user=server.user, password=server.password,
                         dbname=server.database, autocommit=True) as connection:
        connection.execute(f'CREATE DATABASE "{name}"')
    return server.url.rsplit("/", 1)[0] + "/" + name


def count_rows(url: str, sql: str) -> list[tuple]:
    engine = connect(url)
    try:
        with engine.connect() as connection:
            return [tuple(row) for row in connection.execute(text(sql))]
    finally:
        engine.dispose()


def wait_until(predicate, timeout_s: float = 30.0, poll_s: float = 0.05, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(poll_s)
    raise TimeoutError(f"{what} not reached within {timeout_s}s")


def spool_result_ids(path: Path) -> list[str]:
    """Result ids waiting in a buffer file, read with plain sqlite3 (the collector may be dead)."""
    import json
    import sqlite3

    with sqlite3.connect(str(path)) as db:
        return [json.loads(p)["result_id"] for (p,) in db.execute("SELECT payload FROM entries WHERE kind = 'result'")]


SMALL_PROBES = ProbeSet((
    Probe(id="legal-indemnity", domain="legal", version=1, max_tokens=4, system="Answer as counsel.",
          prompt="Does the licensee indemnify the licensor under this contract?"),
    Probe(id="tech-routes", domain="tech", version=1, max_tokens=4, system="",
          prompt="Which command shows the kernel routing table on Linux?"),
), source="prod-tests-small")  # real-engine tests: 4 tokens keep a probe well under a second


@contextmanager
def serving(app) -> Iterator[str]:
    """Run an ASGI app under uvicorn on a free 127.0.0.1 port in a thread; yield its base URL."""
    import socket

    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        wait_until(lambda: server.started or not thread.is_alive(), 30, 0.02, "uvicorn start")
        if not server.started:
            raise RuntimeError("uvicorn did not start")
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=20)
        sock.close()


class _BaselineHandler(BaseHTTPRequestHandler):
    """A plain OpenAI-compatible server, as vLLM or TGI answer: no pruning headers, no `prunewatch` field."""

    delay_s = 0.0
    requests: list = []

    def log_message(self, *args) -> None:  # keep test output clean
        pass

    def _send(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        if self.path == "/v1/models":
            self._send(200, {"object": "list", "data": [{"id": "baseline-model", "object": "model"}]})
        else:
            self._send(404, {"error": {"message": "not found"}})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).requests.append((dict(self.headers), body))
        time.sleep(type(self).delay_s)
        self._send(200, {"id": "x", "object": "chat.completion", "created": 0, "model": body["model"],
                         "choices": [{"index": 0, "finish_reason": "length",
                                      "message": {"role": "assistant", "content": "plain answer"}}],
                         "usage": {"prompt_tokens": 11, "completion_tokens": 3, "total_tokens": 14}})


@contextmanager
def baseline_server(delay_s: float = 0.0) -> Iterator[tuple[str, list]]:
    """A stdlib HTTP server speaking the OpenAI chat protocol only; yields (base URL, requests seen)."""
    handler = type("Handler", (_BaselineHandler,), {"delay_s": delay_s, "requests": []})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", handler.requests
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)


def pushgateway_binary() -> str | None:
    return which_binary(PUSHGATEWAY_BINARIES)


@contextmanager
def pushgateway_server(workdir: Path) -> Iterator[str]:
    """A real Pushgateway on a free 127.0.0.1 port (Debian: prometheus-pushgateway); yields its URL."""
    binary = find_binary(PUSHGATEWAY_BINARIES, "prometheus-pushgateway", "pushgateway")
    port = free_port()
    record = launch("pushgateway", [binary, f"--web.listen-address=127.0.0.1:{port}",
                                    f"--persistence.file={workdir / 'pushgateway.data'}"], workdir / "pushgateway.log")
    try:
        wait_for_http(record, f"http://127.0.0.1:{port}/-/ready", 30)
        yield f"http://127.0.0.1:{port}"
    finally:
        stop([record], 10)


def main(argv: list[str] | None = None) -> None:
    """A collector process for the kill test: `python -m tests.collector.prod_helpers DB BUFFER PORT ROUNDS DELAY`."""
    import logging
    import sys

    from prunewatch.collector.fleet import FleetSettings, run_collector
    from prunewatch.collector.scheduler import TargetJob

    db_url, buffer_path, port, rounds, delay = (argv or sys.argv[1:])[:5]
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s %(message)s")
    settings = FleetSettings(db_url=db_url, buffer_path=Path(buffer_path), metrics_port=int(port), rounds=int(rounds),
                             backoff_initial_s=0.1, backoff_max_s=0.3, drain_timeout_s=60)
    outcome = run_collector(settings, [TargetJob(FakeTarget(delay_s=float(delay)), PROBES, interval_s=0.2)])
    print(f"rounds={outcome.rounds} results={outcome.results} written={outcome.written} buffered={outcome.buffered}")


if __name__ == "__main__":
    main()
