"""A local stand-in for Slack's incoming-webhook endpoint: records every post, can fail or go away on demand."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from tests.support.servers import free_port


@dataclass(frozen=True)
class Post:
    path: str
    body: dict[str, Any]
    status: int  # what the receiver answered
    at: float  # time.monotonic() when it arrived

    @property
    def title(self) -> str:
        attachments = self.body.get("attachments") or [{}]
        return str(attachments[0].get("title", ""))

    @property
    def text(self) -> str:
        attachments = self.body.get("attachments") or [{}]
        return str(attachments[0].get("text", ""))


class SlackReceiver:
    """HTTP server on 127.0.0.1; `fail_next(n)` answers errors n times, `stop()`/`start()` take it down and back."""

    def __init__(self, port: int | None = None) -> None:
        self.port = port or free_port()
        self.posts: list[Post] = []
        self._failures_left = 0
        self._failure_status = 500
        self._retry_after: str | None = None
        self._matching: Callable[[dict[str, Any]], bool] | None = None
        self._lock = threading.Lock()
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> SlackReceiver:
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length", "0"))
                body = json.loads(self.rfile.read(length) or b"{}")
                with receiver._lock:
                    fail = receiver._failures_left > 0 and (receiver._matching is None or receiver._matching(body))
                    status = receiver._failure_status if fail else 200
                    retry_after = receiver._retry_after if fail else None
                    receiver._failures_left -= 1 if fail else 0
                    receiver.posts.append(Post(self.path, body, status, time.monotonic()))
                answer = b"ok" if status == 200 else b"no_service" if status == 404 else b"internal_error"
                self.send_response(status)
                self.send_header("Content-Type", "text/plain")
                self.send_header("Content-Length", str(len(answer)))
                if retry_after is not None:
                    self.send_header("Retry-After", retry_after)
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, *_args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05},
                                        daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        if self._thread is not None:
            self._thread.join(5)
            self._thread = None

    def fail_next(self, count: int, status: int = 500, retry_after: str | None = None,
                  matching: Callable[[dict[str, Any]], bool] | None = None) -> None:
        """Answer the next `count` posts (those `matching`, when given) with `status` and optional Retry-After."""
        with self._lock:
            self._failures_left, self._failure_status, self._retry_after = count, status, retry_after
            self._matching = matching

    def snapshot(self) -> list[Post]:
        with self._lock:
            return list(self.posts)

    def wait_for(self, predicate: Callable[[Post], bool], timeout_s: float, *, status: int = 200) -> Post:
        """The first post matching `predicate` answered with `status`, polling until `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for post in self.snapshot():
                if post.status == status and predicate(post):
                    return post
            time.sleep(0.05)
        seen = [(p.path, p.status, p.title) for p in self.snapshot()]
        raise TimeoutError(f"no matching Slack post within {timeout_s}s; received {seen}")
