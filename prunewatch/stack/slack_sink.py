"""A stand-in for Slack's incoming webhooks in the local stack: logs every message it is sent.

    python -m prunewatch.stack.slack_sink --port 9099 --out messages.jsonl

Each POST becomes one JSON line (time received, path, parsed body), and is answered like Slack
answers (200 "ok"), so Alertmanager's delivery path runs exactly as against Slack. GET / answers
200 for readiness checks.
"""

from __future__ import annotations

import argparse
import json
import signal
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

MAX_BODY_BYTES = 1_048_576


def read_messages(path: Path) -> list[dict[str, Any]]:
    """Every message the sink has logged, oldest first (a missing log means none)."""
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def make_handler(out: Path, lock: threading.Lock) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:  # one JSON line per message is the log
            pass

        def _answer(self, status: int, body: bytes) -> None:
            self.send_response(status)
            self.send_header("Content-Type", "text/plain")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:
            self._answer(200, b"prunewatch slack sink\n")

        def do_POST(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            if length > MAX_BODY_BYTES:
                self._answer(413, b"payload_too_large")
                return
            raw = self.rfile.read(length)
            try:
                body: Any = json.loads(raw or b"null")
            except ValueError:
                self._answer(400, b"invalid_payload")
                return
            record = {"received_at": time.time(), "path": self.path, "body": body}
            with lock, out.open("a") as handle:
                handle.write(json.dumps(record) + "\n")
            self._answer(200, b"ok")

    return Handler


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m prunewatch.stack.slack_sink", description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--out", type=Path, required=True, help="JSON-lines file the messages are appended to")
    args = parser.parse_args(argv)
    server = ThreadingHTTPServer((args.host, args.port), make_handler(args.out, threading.Lock()))
    signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=server.shutdown, daemon=True).start())
    try:
        server.serve_forever(poll_interval=0.2)
    finally:
        server.server_close()


if __name__ == "__main__":
    main()
