"""OpenAI-style error objects, and the handlers that turn every failure into one.

Clients written for OpenAI read `{"error": {"message", "type", "param", "code"}}`; the SDK raises
typed exceptions from the status code and shows `message`. Every non-2xx answer of this server,
from auth to validation to an unexpected crash, has that shape.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from prunewatch.engine.errors import InvalidRequestError

logger = logging.getLogger("prunewatch.server")

INVALID_REQUEST = "invalid_request_error"
AUTHENTICATION = "authentication_error"
RATE_LIMIT = "rate_limit_error"
SERVER_ERROR = "server_error"


def error_body(message: str, type_: str = INVALID_REQUEST, param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    """The OpenAI error object."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


class APIError(Exception):
    """A failure with a known HTTP status, raised anywhere in a request and rendered by a handler."""

    def __init__(self, status_code: int, message: str, *, type_: str = INVALID_REQUEST, param: str | None = None,
                 code: str | None = None, headers: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.type = type_
        self.param = param
        self.code = code
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status_code, headers=self.headers)


def invalid_request(error: InvalidRequestError, param: str | None = None) -> APIError:
    """The engine's out-of-range request parameters are the client's fault: 400."""
    return APIError(400, str(error), param=param, code="invalid_value")


# pydantic's union member tags in an error location: 'str', 'list[TextPart]', 'function-after[...]',
# and a batch item's discriminator value ('/v1/completions'), which no client field is named after.
_UNION_BRANCH = re.compile(r"^(str|int|float|bool|none|[\w-]+\[.*\]|/.*)$")


def _loc(loc: tuple[Any, ...]) -> str:
    """`body.messages.0.content.list[TextPart]` -> `messages.0.content`: the field a client sent;
    `body.requests.0./v1/completions.custom_id` -> `requests.0.custom_id`."""
    parts = [str(p) for p in loc]
    if parts and parts[0] in ("body", "header", "query", "path"):
        parts = parts[1:]
    return ".".join(p for p in parts if not _UNION_BRANCH.match(p)) or "body"


def validation_error(exc: RequestValidationError) -> APIError:
    """Pydantic errors as one 422: the message lists every problem, `param` names the first."""
    errors = list(exc.errors())
    if errors and errors[0].get("type") == "json_invalid":
        reason = (errors[0].get("ctx") or {}).get("error", "JSON decode error")
        return APIError(422, f"The request body is not valid JSON: {reason}", code="validation_error")
    message = "; ".join(f"{_loc(tuple(e.get('loc', ())))}: {e.get('msg', 'invalid')}" for e in errors)
    param = _loc(tuple(errors[0].get("loc", ()))) if errors else None
    return APIError(422, message or "invalid request", param=param, code="validation_error")


_HTTP_CODES = {400: "invalid_request_body", 404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}
_REASON_CHARS = 200


def _reason(error: BaseException) -> str:
    """Why a body could not be read, for the client: the first clause of the error, cut short.

    FastAPI answers 400 "There was an error parsing the body" for what json.loads refuses beyond
    syntax: an integer of more than 4300 digits, bytes that are not UTF-8, nesting too deep to
    recurse into. What follows a ';' is Python's advice to the server's operator, not the client's.
    """
    return str(error).split(";", 1)[0][:_REASON_CHARS] or type(error).__name__


def install_error_handlers(app: FastAPI) -> None:
    """Register handlers so that no error escapes in FastAPI's own `{"detail": ...}` shape."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_error(exc).response()

    @app.exception_handler(InvalidRequestError)
    async def _engine_invalid(request: Request, exc: InvalidRequestError) -> JSONResponse:
        return invalid_request(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = exc.detail if isinstance(exc.detail, str) else "HTTP error"
        if exc.status_code == 400 and exc.__cause__ is not None:  # FastAPI could not read the body
            message = f"{message}: {_reason(exc.__cause__)}"
        return APIError(exc.status_code, message, code=_HTTP_CODES.get(exc.status_code),
                        headers=exc.headers).response()

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error on %s %s", request.method, request.url.path)
        return APIError(500, "The server had an error while processing your request.", type_=SERVER_ERROR,
                        code="internal_error").response()
