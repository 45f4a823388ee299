"""Serve the collector's /metrics from a render cached until a sample changes.

Why: prometheus_client renders the text format in Python at roughly 10-20 µs per sample, so a
collector watching many targets (10k series) spends 100+ ms of CPU per scrape, and every
Prometheus replica scrapes it. Yet its samples only change when a probe result is recorded
(seconds apart) or the store buffer moves. So the exposition is rendered at most once per change
(`CollectorMetrics.state_key`) and each scrape sends the cached bytes (gzip-compressed once, too,
when the scraper accepts it). Only the collector's own registry may be served this way: its every
sample moves through CollectorMetrics, which is what makes the key exact.
"""

from __future__ import annotations

import gzip
import threading
from collections.abc import Hashable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from prunewatch.records.metrics import CollectorMetrics


class CachedExposition:
    """The registry's text exposition, re-rendered only when the metrics' state key changes."""

    def __init__(self, metrics: CollectorMetrics) -> None:
        self.metrics = metrics
        self._lock = threading.Lock()
        self._key: Hashable = object()
        self._body = b""
        self._gzipped: bytes | None = None
        self.renders = 0

    def body(self, gzipped: bool = False) -> bytes:
        with self._lock:
            key = self.metrics.state_key()  # before rendering: a change during the render re-renders next time
            if key != self._key:
                self._body = generate_latest(self.metrics.registry)
                self._gzipped = None
                self._key = key
                self.renders += 1
            if not gzipped:
                return self._body
            if self._gzipped is None:
                self._gzipped = gzip.compress(self._body, compresslevel=5)
            return self._gzipped


class MetricsPortError(RuntimeError):
    """The /metrics endpoint cannot listen where it was asked to (port taken, address not local)."""


def start_metrics_server(metrics: CollectorMetrics, host: str,
                         port: int) -> tuple[ThreadingHTTPServer, threading.Thread]:
    """Serve GET /metrics on host:port in a daemon thread; call `.shutdown()` on the server to stop.

    Raises MetricsPortError when the address cannot be bound, before any probe runs."""
    exposition = CachedExposition(metrics)

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path.split("?", 1)[0] not in ("/metrics", "/"):
                self.send_error(404, "only /metrics is served here")
                return
            gzipped = "gzip" in self.headers.get("Accept-Encoding", "")
            body = exposition.body(gzipped)
            self.send_response(200)
            self.send_header("Content-Type", CONTENT_TYPE_LATEST)
            self.send_header("Content-Length", str(len(body)))
            if gzipped:
                self.send_header("Content-Encoding", "gzip")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:  # scrapes are not news
            pass

    try:
        server = ThreadingHTTPServer((host, port), Handler)
    except OSError as exc:
        raise MetricsPortError(f"cannot serve /metrics on {host}:{port}: {exc.strerror or exc}; "
                               "choose another --metrics-port (0 disables the endpoint)") from exc
    server.daemon_threads = True
    server.exposition = exposition  # type: ignore[attr-defined]
    thread = threading.Thread(target=server.serve_forever, name="prunewatch-metrics", daemon=True)
    thread.start()
    return server, thread
