"""Pure ASGI middleware: request metrics (outermost), API-key auth, request body size limit.

Pure ASGI rather than `BaseHTTPMiddleware` so streamed responses pass through untouched and auth
runs before the body is read or parsed: an unauthenticated client learns nothing about validation.
Keys come only from the Authorization header; one in the query string is refused, since URLs end
up in access logs and proxy logs (see `redaction`).
"""

from __future__ import annotations

import time

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from prunewatch.server.auth import ApiKeyAuth
from prunewatch.server.errors import AUTHENTICATION, APIError
from prunewatch.server.metrics import ServerMetrics
from prunewatch.server.redaction import has_secret_param

HEALTH_PATH = "/health"
METRICS_PATH = "/metrics"
# The API description holds no data and the docs page fetches it without credentials.
DOCS_PATHS = frozenset({"/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc"})
KNOWN_ENDPOINTS = frozenset({
    "/v1/chat/completions", "/v1/completions", "/v1/batch", "/v1/models", "/v1/pruning/policy", HEALTH_PATH,
    METRICS_PATH,
}) | DOCS_PATHS


def endpoint_label(path: str) -> str:
    """A bounded label set: unknown paths (scanners, fuzzers) all count as 'other'."""
    if path in KNOWN_ENDPOINTS:
        return path
    if path.startswith("/v1/models/"):
        return "/v1/models/{model}"
    return "other"


class RequestMetricsMiddleware:
    """Counts every HTTP answer by endpoint and status, and times it to its last byte."""

    def __init__(self, app: ASGIApp, metrics: ServerMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = 500  # an exception before the response started is a server error

        async def send_wrapper(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            self.metrics.record_request(endpoint_label(scope["path"]), status, time.perf_counter() - started)


class AuthMiddleware:
    """401 unless `Authorization: Bearer <configured key>`; health and the API docs are exempt."""

    def __init__(self, app: ASGIApp, auth: ApiKeyAuth, public_metrics: bool = False) -> None:
        self.app = app
        self.auth = auth
        self.public = {HEALTH_PATH} | DOCS_PATHS | ({METRICS_PATH} if public_metrics else set())

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self.public or not self.auth.enabled:
            await self.app(scope, receive, send)
            return
        sent = Headers(scope=scope).getlist("authorization")
        if len(sent) > 1:  # proxies and servers disagree on which copy counts: accept none of them
            await APIError(401, f"Authorization: sent {len(sent)} times; send it once.", type_=AUTHENTICATION,
                           code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"}).response()(
                scope, receive, send)
            return
        authorization = sent[0] if sent else None
        in_url = has_secret_param(scope.get("query_string", b""), self.auth.is_key)
        if self.auth.is_authorized(authorization) and not in_url:
            await self.app(scope, receive, send)
            return
        if in_url:  # refused even beside a valid header: a key in a URL ends up in proxies' and browsers' logs
            message = ("API keys are not accepted in the URL, where logs keep them; "
                       "send it as 'Authorization: Bearer YOUR_KEY'.")
        elif authorization:
            message = "Incorrect API key provided."
        else:
            message = "You didn't provide an API key. Send it as 'Authorization: Bearer YOUR_KEY'."
        error = APIError(401, message, type_=AUTHENTICATION, code="invalid_api_key",
                         headers={"WWW-Authenticate": "Bearer"})
        await error.response()(scope, receive, send)


def _exceeds(content_length: str, limit: int) -> bool:
    """Whether a Content-Length header states more than `limit` bytes; compared by its digits first,
    since int() refuses more than 4300 of them. A malformed value is left to the body count."""
    if not (content_length.isascii() and content_length.isdigit()):
        return False
    digits = content_length.lstrip("0")
    return len(digits) > len(str(limit)) or int(digits or "0") > limit


class BodyLimitMiddleware:
    """413 for a body over `max_bytes`: at once from Content-Length, else once the count passes it.

    The body is read here, up to the limit, and handed to the app in one piece. Raising from inside
    the app's own body read would not do: FastAPI turns any error there into a 400 "error parsing
    the body", which is what a chunked upload (no Content-Length) used to get. Buffering costs
    nothing extra, since the routes read the whole JSON body before parsing it anyway.
    """

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    def _too_large(self) -> APIError:
        return APIError(413, f"The request body is larger than this server's limit of {self.max_bytes} bytes.",
                        code="request_too_large")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = Headers(scope=scope).get("content-length")
        if length is not None and _exceeds(length, self.max_bytes):
            await self._too_large().response()(scope, receive, send)
            return
        chunks: list[bytes] = []
        received = 0
        left: Message | None = None  # http.disconnect before the body ended
        more_body = True
        while more_body:
            message = await receive()
            if message["type"] != "http.request":
                left = message
                break
            chunk = message.get("body", b"")
            received += len(chunk)
            if received > self.max_bytes:
                await self._too_large().response()(scope, receive, send)
                return
            chunks.append(chunk)
            more_body = message.get("more_body", False)
        replayed = False

        async def replay() -> Message:
            """The whole body once, then the client's own messages (a streaming route waits on them
            for http.disconnect). A client gone mid-body is shown to the app as such, which answers
            it as it would without this middleware, rather than leaving no status to count."""
            nonlocal replayed
            if left is not None:
                return left
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": b"".join(chunks), "more_body": False}

        await self.app(scope, replay, send)
